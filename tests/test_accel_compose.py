"""accel.compose: the composite runs each policy on its own state; plans and selections combine or fail."""
import jax
import numpy as np
import pytest

from accel import FastVAR, compose, policy_from_spec
from accel.compose import Composed, merge_plans
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
  with pytest.raises(ValueError, match='next-scale policies'):
    compose(FastVAR(ratios=((4, 1.0),)), object())
  with pytest.raises(ValueError, match='FastVAR.blocks: block 5 is past the depth 2'):
    make_sampler(var_cfg, vq_cfg, compose(ScalePolicy(), FastVAR(ratios=((4, 0.5),), cache_at=3, blocks=(5,))))


def test_specs_name_presets_and_compose_with_plus():
  assert policy_from_spec('fastvar:var256') == FastVAR.preset('var256')
  assert type(policy_from_spec('baseline')) is ScalePolicy
  both = policy_from_spec('fastvar:infinity_2b+baseline')
  assert isinstance(both, Composed) and both.policies[0] == FastVAR.preset('infinity_2b')
  with pytest.raises(ValueError, match="policy 'nosuchmethod:x'"):
    policy_from_spec('nosuchmethod:x')
  with pytest.raises(ValueError, match="unknown FastVAR preset 'x'"):
    policy_from_spec('fastvar:x')
