"""LazyVAR: the update index, the cumulative retention, the group step, equality with the baseline."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from accel.lazyvar import PRESETS, LazyVAR, cumulative_offsets, kept_count, retained, update_index
from var_models.var.model import VARConfig
from var_models.var.policy import Site, var_binding
from var_models.var.schedules import INFINITY_1024, ScaleSchedule


def _binding(sched, depth):
  """What the sampler of a depth-block VAR on sched binds its policy to."""
  return var_binding(VARConfig(depth=depth, patch_nums=sched.patch_nums))


def test_update_index_is_one_minus_cosine_per_position():
  f_prev = jnp.array([[[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [3.0, 4.0]]]])
  f_now = jnp.array([[[[2.0, 0.0], [0.0, 5.0], [-1.0, 0.0], [4.0, 3.0]]]])
  np.testing.assert_allclose(update_index(f_prev, f_now), [[[0.0, 1.0, 2.0, 1.0 - 24 / 25]]], atol=1e-6)


def test_kept_counts_round_half_up_and_zero_forwards_nothing():
  assert [kept_count(n, r) for n, r in [(1024, 0.2), (1600, 0.1), (2304, 0.05), (4096, 0.01)]] == [205, 160, 115, 41]
  assert kept_count(16, 0.01) == 1 and kept_count(16, 0.0) == 0 and kept_count(16, 1.0) == 16


def test_cumulative_offsets_on_infinitys_group():
  sides, retention = (32, 40, 48, 64), (0.2, 0.1, 0.05, 0.01)
  assert cumulative_offsets(sides, retention, 64, 'area') == (164, 96, 23, 0)
  assert cumulative_offsets(sides, retention, 64, 'literal') == (655, 246, 41, 0)
  assert cumulative_offsets(sides, retention, 64, 'none') == (0, 0, 0, 0)
  # Clamped so the scale's own kept tokens fit: 4 tokens, 2 kept, the larger scale claims 3.
  assert cumulative_offsets((2, 4), (0.5, 0.75), 4, 'area') == (2, 0)


def test_retained_takes_its_rank_window_of_the_downsampled_index():
  # A 4x4 index whose 2x2 area means are, row-major: 4.0, 1.0, 3.0, 2.0 (one row of the batch)
  # and reversed in the other, so each batch row selects apart.
  means = np.array([[4.0, 1.0], [3.0, 2.0]])
  index = np.kron(means, np.ones((2, 2)))[None]
  index = jnp.asarray(np.concatenate([index, index[:, ::-1, ::-1]]))
  np.testing.assert_array_equal(retained(index, 2, 1, 0), [[0], [3]])        # the highest
  np.testing.assert_array_equal(retained(index, 2, 2, 1), [[2, 3], [0, 1]])  # ranks 1-2, ascending
  ties = jnp.ones((1, 2, 2))
  np.testing.assert_array_equal(retained(ties, 2, 2, 1), [[1, 2]])           # ties: lower position first


def test_presets_bind_to_their_schedules():
  for name in PRESETS:
    policy = LazyVAR.preset(name)
    sched = ScaleSchedule((1, 2, 3, 4, 5, 6, 8, 10, 13, 16)) if name == 'var256' else INFINITY_1024
    bound = policy.bind(_binding(sched, 4))
    steps = bound.plan(sched)
    assert [si for s in steps for si in s.scales] == list(range(sched.num_scales))
  group = LazyVAR.preset('infinity_2b').bind(_binding(INFINITY_1024, 4)).plan(INFINITY_1024)[-1]
  assert group.scales == (9, 10, 11, 12)
  assert LazyVAR.preset('no_pgd').bind(_binding(INFINITY_1024, 4)).plan(INFINITY_1024)[-1].scales == (12,)


@pytest.mark.parametrize('settings,match', [
    (dict(start=9, retention=(0.2, 1.5, 0.05, 0.01)), r'LazyVAR.retention: every retention must be in \[0, 1\]'),
    (dict(start=0, retention=(0.5,)), 'LazyVAR.start: scale 0'),
    (dict(start=9, retention=(0.2,), cum='sum'), 'LazyVAR.cum: must be one of'),
])
def test_bad_settings_are_errors_naming_the_field(settings, match):
  with pytest.raises(ValueError, match=match):
    LazyVAR(**settings)


def test_a_group_that_does_not_reach_the_last_scale_is_an_error():
  with pytest.raises(ValueError, match='LazyVAR.retention: 2 scales from start=9 must reach the last'):
    LazyVAR(start=9, retention=(0.2, 0.1)).bind(_binding(INFINITY_1024, 4))



def test_nothing_pruned_in_steps_of_one_scale_is_the_baseline_bit_for_bit(sample_tiny):
  images, aux = sample_tiny()
  lazy, lazy_aux = sample_tiny(LazyVAR(start=2, retention=(1.0, 1.0), pgd=False))
  np.testing.assert_array_equal(lazy, images)
  for a, b in zip(lazy_aux['indices'], aux['indices']):
    np.testing.assert_array_equal(a, b)


def test_pruned_tokens_have_no_query_and_no_keys_in_any_layer(tiny_var, sample_tiny):
  """Every attention call of the group step: 5 + 4 kept queries (scales 2 and 3 of 9 and 16
  tokens at 50 % and 25 %) over the 1 + 4 cached keys and those 9, under the block-causal
  mask of the kept tokens' own scales."""
  import dataclasses
  from var_models.nn import attention
  calls = []

  def record(q, k, v, mask, scale, kv_len):
    calls.append((q.shape[1], k.shape[1] if kv_len is None else kv_len, mask))
    return attention._BACKENDS['xla'](q, k, v, mask, scale, kv_len)

  attention.register_backend('record_lazyvar', record)
  var_cfg = dataclasses.replace(tiny_var[0], attn_backend='record_lazyvar')
  _, aux = sample_tiny(LazyVAR(start=2, retention=(0.5, 0.25)), var_cfg)
  assert [c[:2] for c in calls] == [(1, 1)] * 2 + [(4, 5)] * 2 + [(9, 14)] * 2
  mask = calls[-1][2]
  np.testing.assert_array_equal(mask.q_levels, [2] * 5 + [3] * 4)
  np.testing.assert_array_equal(mask.k_levels, [0] + [1] * 4 + [2] * 5 + [3] * 4)
  for si, kept in ((2, 5), (3, 4)):
    indices = np.asarray(aux['indices'][si])
    assert ((indices >= 0).sum(axis=1) == kept).all()   # the others were not sampled (-1)


def test_the_group_takes_disjoint_positions_by_the_index_before_it():
  """Scale 2 (3x3) and 3 (4x4) of one group share f_hat's update index; with the 'area' reading
  scale 3 keeps the 4 highest, scale 2 the ranks after the 25 % the larger scale claims."""
  policy = LazyVAR(start=2, retention=(0.5, 0.25)).bind(_binding(ScaleSchedule((1, 2, 3, 4)), 2))
  f_prev = jax.random.normal(jax.random.key(0), (1, 4, 4, 8))
  f_now = f_prev + jnp.linspace(0, 3, 16).reshape(1, 4, 4, 1) * jax.random.normal(jax.random.key(1), (1, 4, 4, 8))
  state = {'f_prev': f_prev, 'f_now': f_now}
  step = policy.plan(ScaleSchedule((1, 2, 3, 4)))[-1]
  sel, _ = policy.select_input(Site(2, step), jnp.zeros((2, 25, 4)), state)
  u = update_index(f_prev, f_now)
  np.testing.assert_array_equal(sel[:, 5:] - 9, retained(u, 4, 4, 0).repeat(2, axis=0))
  np.testing.assert_array_equal(sel[:, :5], retained(u, 3, 5, 2).repeat(2, axis=0))
  assert sel.shape == (2, 9) and policy.input_counts(step) == (5, 4)


def test_lazyvar_composes_with_fastvar_on_other_scales(sample_tiny):
  """FastVAR prunes scale 2 inside its blocks (cache at scale 1), LazyVAR drops half the input
  tokens of scale 3: one sampler, each method's tokens where it acts."""
  from accel import FastVAR, compose
  policy = compose(FastVAR(ratios=((3, 0.5),), cache_at=2), LazyVAR(start=3, retention=(0.5,), pgd=False))
  images, aux = sample_tiny(policy)
  assert np.isfinite(np.asarray(images)).all()
  assert (np.asarray(aux['indices'][2]) >= 0).all()                    # FastVAR restores every position
  assert ((np.asarray(aux['indices'][3]) >= 0).sum(axis=1) == 8).all()  # LazyVAR forwards 8 of 16
