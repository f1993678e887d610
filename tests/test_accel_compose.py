"""accel.compose: the composite runs each policy on its own state; plans and selections combine or fail."""
import dataclasses
import re

import jax
import numpy as np
import pytest

from accel import ECARConditionCache, FastVAR, LazyMAR, compose, policy_from_spec
from accel.compose import Composed, merge_plans
from accel.specs import split_specs
from test_var_sampler import _CondOnly
from var_models.var.policy import ScalePolicy, Step
from var_models.var.sampler import make_sampler
from var_models.var.schedules import ScaleSchedule

LABELS = np.array([1, 7, 3], np.int32)
SCHED = ScaleSchedule((1, 2, 3, 4))


def test_pruning_composed_with_skipping_equals_one_policy_doing_both(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  both = FastVAR(ratios=((3, 0.5), (4, 1.0)), cache_at=2)
  parts = compose(FastVAR(ratios=((3, 0.5),), cache_at=2), FastVAR(ratios=((4, 1.0),)))
  want, aux_w = make_sampler(var_cfg, vq_cfg, both)(params, jax.random.key(2), LABELS, cfg=1.5)
  got, aux_g = make_sampler(var_cfg, vq_cfg, parts)(params, jax.random.key(2), LABELS, cfg=1.5)
  np.testing.assert_array_equal(got, want)
  for a, b in zip(aux_g['indices'], aux_w['indices'], strict=True):
    np.testing.assert_array_equal(a, b)


def test_plans_merge_baseline_into_the_other_and_skips_into_the_shorter():
  base = ScalePolicy().plan(SCHED)
  skip1, skip2 = base[:3], base[:2]
  group = (Step((0,)), Step((1,)), Step((2, 3)))
  assert merge_plans([base, skip1], SCHED) == skip1
  assert merge_plans([skip1, base, skip2], SCHED) == skip2
  assert merge_plans([group, base], SCHED) == group
  with pytest.raises(ValueError, match='compose: the policies plan the steps differently'):
    merge_plans([group, skip1], SCHED)


def test_two_policies_selecting_one_sublayer_is_an_error(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  a = FastVAR(ratios=((4, 0.5),), cache_at=3)
  sample = make_sampler(var_cfg, vq_cfg, compose(a, a))
  with pytest.raises(ValueError, match="compose: two policies select the tokens of sub-layer 'attn'"):
    sample(params, jax.random.key(0), LABELS)


def test_compose_checks_its_arguments_and_each_policy_against_the_schedule(tiny_var):
  var_cfg, vq_cfg, _ = tiny_var
  with pytest.raises(ValueError, match='at least two policies'):
    compose(FastVAR(ratios=((4, 1.0),)))
  with pytest.raises(ValueError, match='got object, not a next-scale policy'):
    compose(FastVAR(ratios=((4, 1.0),)), object())
  with pytest.raises(ValueError, match='FastVAR.blocks: block 5 is past the depth 2'):
    make_sampler(var_cfg, vq_cfg, compose(ScalePolicy(), FastVAR(ratios=((4, 0.5),), cache_at=3, blocks=(5,))))


def test_policies_of_other_families_are_refused_naming_the_family():
  skip = FastVAR(ratios=((4, 1.0),))
  message = ('compose combines next-scale (VAR) policies; got LazyMAR, a MAR policy '
             '(MAR and E-CAR have one accelerator each: nothing to compose)')
  with pytest.raises(ValueError, match=re.escape(message)):
    compose(skip, LazyMAR.preset('official'))
  with pytest.raises(ValueError, match='got ECARConditionCache, an E-CAR policy'):
    compose(ECARConditionCache(interval=2), skip)


def test_one_policy_may_guide_on_its_own_slot_two_are_an_error(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  guider, skip = _CondOnly(), FastVAR(ratios=((4, 1.0),))
  args = (params, jax.random.key(0), LABELS)
  _, aux = make_sampler(var_cfg, vq_cfg, compose(skip, guider), return_logits=True)(*args, cfg=1.5, top_k=1)
  _, plain = make_sampler(var_cfg, vq_cfg, skip, return_logits=True)(*args, cfg=0.0, top_k=1)
  for got, want in zip(aux['logits'], plain['logits'], strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert guider.seen == [(0, 1), (1, 2), (2, 3)]   # scale 3 skipped
  with pytest.raises(ValueError, match=r'at most one policy may make the guided halves .*; _CondOnly, _CondOnly do'):
    compose(guider, skip, _CondOnly())


def test_specs_name_presets_and_compose_with_plus():
  assert policy_from_spec('fastvar:var256') == FastVAR.preset('var256')
  assert type(policy_from_spec('baseline')) is ScalePolicy
  both = policy_from_spec('fastvar:infinity_2b+baseline')
  assert isinstance(both, Composed) and both.policies[0] == FastVAR.preset('infinity_2b')
  with pytest.raises(ValueError, match="policy 'nosuchmethod:x'"):
    policy_from_spec('nosuchmethod:x')
  with pytest.raises(ValueError, match="unknown FastVAR preset 'x'"):
    policy_from_spec('fastvar:x')


def test_spec_settings_in_brackets_change_the_preset_and_are_checked():
  got = policy_from_spec('fastvar:infinity_2b[cache_at=3][blocks=(2, 5)]')
  want = FastVAR.preset('infinity_2b')
  assert got == dataclasses.replace(want, cache_at=3, blocks=(2, 5), source='infinity_2b[cache_at=3][blocks=(2, 5)]: '
                                    + want.source.partition(': ')[2])
  with pytest.raises(ValueError, match="FastVAR has no setting 'nope'; known: .*'ratios'"):
    policy_from_spec('fastvar:infinity_2b[nope=1]')
  with pytest.raises(ValueError, match="cache_at='x' is not a Python literal"):
    policy_from_spec('fastvar:infinity_2b[cache_at=x]')
  with pytest.raises(ValueError, match=r"settings must be '\[field=value\]' each"):
    policy_from_spec('fastvar:infinity_2b[cache_at=3]x')
  with pytest.raises(ValueError, match='unbalanced brackets'):
    policy_from_spec('fastvar:infinity_2b[cache_at=3')


def test_comma_separated_specs_keep_the_commas_of_their_settings():
  specs = split_specs('fastvar:infinity_2b[blocks=(3, 4)], baseline,fastvar:var256[ratios=((13, 0.5),)]+baseline')
  assert specs == ['fastvar:infinity_2b[blocks=(3, 4)]', 'baseline', 'fastvar:var256[ratios=((13, 0.5),)]+baseline']
  assert policy_from_spec(specs[0]).blocks == (3, 4)
  assert policy_from_spec(specs[2]).policies[0].ratios == ((13, 0.5),)
  with pytest.raises(ValueError, match='unbalanced brackets'):
    split_specs('fastvar:var256[cache_at=(1]')
