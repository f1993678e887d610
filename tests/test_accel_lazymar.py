"""LazyMAR: every cache off is the baseline bit for bit; the keep set, refresh schedule, head-cache steps
and condition-cache algebra against hand-made cases; the sampler's recorded decisions; bad settings fail
before compiling."""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from accel.lazymar import (OFFICIAL_RATIOS, LazyMAR, is_refresh, keep_count, kept_positions,
                           similarity_scores)
from var_models.mar import diffloss
from var_models.mar import model as mar_lib
from var_models.mar.diffloss import (HeadCache, SimpleMLPAdaLN, diffloss_sample, diffloss_sample_cached,
                                     merged_adaln)
from var_models.mar.gaussian_diffusion import create_diffusion, fold_runs
from var_models.mar.model import diffloss_net
from var_models.mar.policy import IterPlan
from var_models.mar.sampler import make_mar_sampler
from var_models.mar.schedule import MARSchedule, mask_schedule, merge_sizes
from var_models.nn import blocks
from var_models.nn.policy import Binding, Halves
from test_mar_sampler import LABELS, MAR_CFG, VAE_CFG, _params

CFG = dataclasses.replace(MAR_CFG, decoder_depth=3)
NUM_ITER = 6
TINY = dict(refresh_start=2, refresh_every=3, ratios=(1.0, 1.0, 1.0, 0.5, 0.2, 0.2), similarity_block=1,
            extra_tokens=1, head_interval=3, head_skip=(1,))
OFF = dict(encoder=False, decoder=False, condition=False, head=False)


def _binding(cfg, num_iter, diffusion_steps):
  """What a guided sampler of `num_iter` iterations and `diffusion_steps` head steps binds its policy to."""
  return Binding(cfg, MARSchedule(mask_schedule(cfg.seq_len, num_iter), diffusion_steps), guided=True)


@pytest.fixture(scope='module')
def params():
  return _params(CFG)


@pytest.fixture(scope='module')
def baseline_tokens(params):
  return make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER)(params, jax.random.key(3), LABELS, cfg=3.0)[1]['tokens']


def test_every_cache_off_equals_the_baseline_bit_for_bit(params, baseline_tokens):
  sample = make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, policy=LazyMAR(**TINY, **OFF))
  np.testing.assert_array_equal(sample(params, jax.random.key(3), LABELS, cfg=3.0)[1]['tokens'], baseline_tokens)


def test_all_caches_record_refreshes_encoder_sets_and_kept_counts(params, baseline_tokens):
  sample = make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, policy=LazyMAR(**TINY), record=True)
  _, aux = sample(params, jax.random.key(3), LABELS, cfg=3.0)
  it, bound = aux['iterations'], sample.policy.bound
  # The encoder cache runs the encoder on every position (a cached iteration forwards a few).
  assert sample.encoder_lengths == (None,) * NUM_ITER
  np.testing.assert_array_equal(it['refresh'], [True, True, True, False, False, True])
  np.testing.assert_array_equal(it['kept'].sum(-1)[:, 0], bound.keep)
  pred = np.asarray(it['pred'])
  # A cached iteration encodes the buffer and the previous iteration's predictions only.
  for step in (3, 4):
    want = np.zeros((len(LABELS), bound.length), bool)
    want[:, :CFG.buffer_size] = True
    prev = pred[step - 1]
    np.put_along_axis(want, np.where(prev < CFG.seq_len, prev + CFG.buffer_size, 0), True, axis=1)
    np.testing.assert_array_equal(it['encoded'][step], want)
  # Positions predicted now and at the previous iteration score 0: always kept here.
  for step in (3, 4):
    for now in (pred[step], pred[step - 1]):
      rows = np.repeat(np.arange(len(LABELS))[:, None], now.shape[1], 1)
      valid = now < CFG.seq_len
      assert it['kept'][step][rows[valid], now[valid] + CFG.buffer_size].all()
  tokens = np.asarray(aux['tokens'])
  assert np.isfinite(tokens).all() and not np.array_equal(tokens, baseline_tokens)


def test_without_the_encoder_cache_the_gathered_encoder_gives_every_positions_tokens(params):
  """The decoder and condition caches leave the encoder unhooked: it runs on the buffer and the known
  positions (padded to 2 lengths), and the decisions and tokens equal those of every position."""
  make = lambda n: make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, policy=LazyMAR(**TINY, encoder=False),
                                    record=True, encoder_sizes=n)
  gathered, every = make(2), make(None)
  assert None not in gathered.encoder_lengths and len(set(gathered.encoder_lengths)) == 2
  assert every.encoder_lengths == (None,) * NUM_ITER
  want, got = (s(params, jax.random.key(3), LABELS, cfg=3.0)[1] for s in (every, gathered))
  for name in ('kept', 'refresh', 'pred'):
    np.testing.assert_array_equal(got['iterations'][name], want['iterations'][name])
  want, got = np.asarray(want['tokens']), np.asarray(got['tokens'])
  assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_decoder_sizes_merged_into_one_change_the_plans_not_the_outputs(params):
  samplers = [make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, policy=LazyMAR(**TINY, decoder_sizes=n), record=True)
              for n in (None, 1)]
  assert [len(set(s.plans)) for s in samplers] == [3, 2]   # full, and one or two cached sizes
  each, one = (s(params, jax.random.key(3), LABELS, cfg=3.0)[1] for s in samplers)
  np.testing.assert_array_equal(one['tokens'], each['tokens'])
  for name in ('kept', 'encoded', 'refresh'):
    np.testing.assert_array_equal(one['iterations'][name], each['iterations'][name])


def test_auto_decoder_sizes_compile_one_cached_size_at_batch_one_and_four_above(params):
  """'auto' (the default) binds per batch: one cached size for a single sample, the outputs those of four."""
  auto, four = (make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, policy=LazyMAR(**TINY, **n), record=True)
                for n in ({}, dict(decoder_sizes=4)))
  assert [len(set(auto.program(b).plans)) for b in (1, 2)] == [2, 3] and len(set(auto.plans)) == 3
  one, each = (s(params, jax.random.key(3), LABELS[:1], cfg=3.0)[1] for s in (auto, four))
  np.testing.assert_array_equal(one['tokens'], each['tokens'])
  np.testing.assert_array_equal(one['iterations']['kept'], each['iterations']['kept'])


def test_merged_sizes_pad_the_fewest_rows_in_at_most_the_groups_asked():
  counts = {28: 21, 38: 5, 48: 4, 128: 5, 160: 3, 192: 1, 320: 13}   # MAR-H's cached iterations at 64
  assert merge_sizes(counts, 4) == {28: 28, 38: 48, 48: 48, 128: 160, 160: 160, 192: 320, 320: 320}
  assert merge_sizes(counts, None) == merge_sizes(counts, 9) == {n: n for n in counts}
  sizes = sorted(counts)
  padded_rows = lambda merged: sum(c * (merged[n] - n) for n, c in counts.items())
  for groups in range(1, len(sizes)):
    merged = merge_sizes(counts, groups)
    assert len(set(merged.values())) <= groups and all(merged[n] >= n for n in sizes)
    best = min(padded_rows({n: sizes[min(c for c in cuts + (len(sizes),) if c > i) - 1]
                            for i, n in enumerate(sizes)})
               for cuts in itertools.combinations(range(1, len(sizes)), groups - 1))
    assert padded_rows(merged) == best


def test_every_cache_traces_with_bfloat16_compute(params):
  """The caches keep the dtypes of what they hold, so the scan carries match in bf16 (the GPU setting)."""
  cfg = dataclasses.replace(CFG, dtype=jnp.bfloat16)
  sample = make_mar_sampler(cfg, VAE_CFG, num_iter=NUM_ITER, policy=LazyMAR(**TINY))
  sample.lower(params, jax.random.key(3), LABELS, cfg=3.0)


def test_keep_count_is_the_larger_of_the_predictions_plus_extra_and_the_ratio():
  assert keep_count(320, 0.05, 3, 4, 15) == 22 and keep_count(320, 0.15, 3, 4, 15) == 48
  assert keep_count(320, 0.12, 1, 1, 15) == 38 and keep_count(20, 1.0, 9, 9, 15) == 20


def test_scores_are_head_mean_cosines_with_the_predicted_positions_zeroed():
  v_prev = jnp.array([[[[1., 0.], [0., 1.]], [[1., 0.], [1., 0.]], [[2., 0.], [0., 3.]]]])   # [1, 3, 2 heads, 2]
  v_now = jnp.array([[[[1., 0.], [1., 0.]], [[-1., 0.], [0., 1.]], [[5., 0.], [0., 1.]]]])
  zero = jnp.array([[False, False, True]])
  np.testing.assert_allclose(similarity_scores(v_now, v_prev, zero), [[0.5, -0.5, 0.0]], atol=1e-7)


def test_kept_positions_take_the_lowest_scores_ties_to_the_lower_position_padded_ascending():
  scores = jnp.array([[0.9, 0.0, -0.2, 0.0, 0.0, 0.5]])
  # count 3: -0.2 (2), then two of the tied zeros (1, 3 before 4); bound 5 pads with L = 6.
  np.testing.assert_array_equal(kept_positions(scores, jnp.int32(3), 5), [[1, 2, 3, 6, 6]])
  np.testing.assert_array_equal(kept_positions(scores, jnp.int32(6), 6), [[0, 1, 2, 3, 4, 5]])


def test_official_refreshes_of_64_iterations_and_the_scaled_schedule_of_32():
  assert [s for s in range(64) if is_refresh(s, 5, 9)] == [0, 1, 2, 3, 4, 5, 14, 23, 32, 41, 50, 59]
  official = LazyMAR.preset('official').bind(_binding(mar_lib.base(), 64, 100))
  assert official.bound.refresh == tuple(is_refresh(s, 5, 9) for s in range(64))
  assert official.ratios == OFFICIAL_RATIOS and len(OFFICIAL_RATIOS) == 64
  scaled = LazyMAR.preset('scaled').scaled_to(32)
  assert (scaled.refresh_start, scaled.refresh_every) == (3, 4)
  assert scaled.ratios == OFFICIAL_RATIOS[::2]
  assert LazyMAR.preset('scaled').scaled_to(64).ratios == OFFICIAL_RATIOS


def test_official_head_cache_steps_and_the_blocks_each_step_runs():
  cache = LazyMAR.preset('official').bind(_binding(mar_lib.base(), 64, 100)).head_cache(IterPlan())
  kinds = cache.kinds(100)
  full = sorted(99 - j for j, k in enumerate(kinds) if k == 'full')
  assert full == [0, 7, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77, 84, 91, 98, 99]
  assert sorted(99 - j for j, k in enumerate(kinds) if k == 'recompute') == [92, 93, 94, 95, 96, 97]
  assert cache.hooks('full').skipped == () and cache.hooks('cached').skipped == (1, 2, 3, 4)
  assert cache.uncond('full') and not cache.uncond('cached') and not cache.uncond('recompute')
  assert fold_runs(kinds)[2] == (13, (('full', 1), ('cached', 6)))


def _head_inputs(rows=3):
  net = diffloss_net(CFG)
  head = _params(CFG)['mar']['diffloss']
  z = jax.random.normal(jax.random.key(7), (2 * rows, CFG.decoder_embed_dim))
  return net, head, z


def test_cache_free_stepped_loop_equals_the_guided_sampler():
  net, head, z = _head_inputs()
  diffusion = create_diffusion('10')
  want = diffloss_sample(net, head, z, jax.random.key(1), 1.0, 2.5, guided=True, diffusion=diffusion)[:3]
  k_init, k_loop = jax.random.split(jax.random.key(1))
  x_t = jax.random.normal(k_init, (3, net.in_channels))
  noise = lambda i: jax.random.normal(jax.random.fold_in(k_loop, i), (6, net.in_channels))[:3]
  got = diffloss_sample_cached(net, head, z, x_t, noise, 1.0, 2.5, HeadCache(), diffusion)
  # Tokens of ~1e5 (a random head, ten steps): float32 rounding, which differs with the CPU's
  # vector width, reaches a few parts in 1e6.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('cached', [False, True])
def test_adaln_outputs_computed_before_the_loop_give_the_per_step_tokens(monkeypatch, cached):
  """Every step's adaLN outputs in one GEMM before the head's loop (up to blocks.ADALN_AHEAD_MAX_ROWS rows),
  or one GEMM a step: the same tokens, plain and through LazyMAR's head cache (each kind its own)."""
  net, head, z = _head_inputs()
  diffusion = create_diffusion('10')
  ahead = diffloss.adaln_ahead(net, head, z, merged_adaln(head), diffusion)
  assert ahead.shape == (10, 6, (3 * net.num_res_blocks + 2) * net.model_channels)
  cache = LazyMAR(**TINY).bind(_binding(CFG, NUM_ITER, 10)).head_cache(IterPlan())
  x_t = jax.random.normal(jax.random.key(2), (3, net.in_channels))
  noise = lambda i: jax.random.normal(jax.random.fold_in(jax.random.key(3), i), (3, net.in_channels))

  def sample(rows):
    monkeypatch.setattr(blocks, 'ADALN_AHEAD_MAX_ROWS', rows)
    if cached:
      return diffloss_sample_cached(net, head, z, x_t, noise, 1.0, 2.5, cache, diffusion)
    return diffloss_sample(net, head, z, jax.random.key(1), 1.0, 2.5, guided=True, diffusion=diffusion)

  want = sample(0)
  assert diffloss.adaln_ahead(net, head, z, merged_adaln(head), diffusion) is None   # 6 rows > 0
  np.testing.assert_allclose(sample(6), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_cached_head_step_right_after_a_full_one_on_the_same_input_repeats_it():
  """x + cached delta and x + gate * cached MLP output are the full step's own values."""
  net, head, z = _head_inputs()
  cache = LazyMAR(**TINY).bind(_binding(CFG, NUM_ITER, 10)).head_cache(IterPlan())
  x = jax.random.normal(jax.random.key(2), (3, net.in_channels))
  t = jnp.full((3,), 500)
  state = cache.init_state(3, net.model_channels, net.num_res_blocks, net.in_channels)
  outs = []
  for kind in ('full', 'cached'):
    both = cache.uncond(kind)
    run = [i for i in range(net.num_res_blocks) if i not in cache.hooks(kind).skipped]
    xx, tt, cc = (jnp.concatenate([x, x]), jnp.concatenate([t, t]), z) if both else (x, t, z[:3])
    adaln = merged_adaln(head, run, gates_only=not cache.hooks(kind).needs_mlp)   # a cached step: gates only
    out, state = net.apply({'params': head}, xx, tt, cc, adaln, cache.hooks(kind), state,
                           method=SimpleMLPAdaLN.forward_hooked)
    eps, state = cache.guide(kind, out[:3, :4], out[3:, :4] if both else None, 2.0, state)
    outs.append(eps)
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(state['cfg']).max()) > 0


def test_condition_cache_keeps_uncond_minus_cond_and_adds_it_to_the_conditional_half():
  policy = LazyMAR(**TINY, **{**OFF, 'condition': True}).bind(_binding(CFG, NUM_ITER, 10))
  state = policy.init_state(2)
  x = jax.random.normal(jax.random.key(0), (4, 20, CFG.decoder_embed_dim))
  state['it'] = {'pred': state['prev_pred']}
  halves, state = policy.guide(IterPlan(tag='full'), Halves(both=lambda: (x[:2], x[2:]), cond=None), state)
  np.testing.assert_array_equal(jnp.concatenate(halves), x)
  np.testing.assert_array_equal(state['diff'], x[2:] - x[:2])
  state['it'] = {'pred': state['prev_pred']}
  cond = jax.random.normal(jax.random.key(1), (2, 20, CFG.decoder_embed_dim))
  (got_cond, uncond), _ = policy.guide(IterPlan(uncond=False, tag=('cached', None)),
                                       Halves(both=None, cond=lambda: cond), state)
  np.testing.assert_array_equal(got_cond, cond)
  np.testing.assert_array_equal(uncond, cond + (x[2:] - x[:2]))


@pytest.mark.parametrize('settings,num_iter,guided,message', [
    (dict(), 8, True, 'LazyMAR.ratios: 64 entries for a sampler of 8'),
    (dict(TINY, similarity_block=3), NUM_ITER, True, 'LazyMAR.similarity_block: block 3 is past'),
    (dict(TINY, head_skip=(1, 2)), NUM_ITER, True, 'LazyMAR.head_skip: block 2 is past'),
    (dict(TINY), NUM_ITER, False, 'LazyMAR.guided'),
    (dict(TINY, **OFF), NUM_ITER, False, 'LazyMAR.guided'),
])
def test_settings_that_do_not_fit_the_sampler_fail_when_it_is_made(settings, num_iter, guided, message):
  with pytest.raises(ValueError, match=message):
    make_mar_sampler(CFG, VAE_CFG, num_iter=num_iter, guided=guided, policy=LazyMAR(**settings))


@pytest.mark.parametrize('settings,message', [
    (dict(refresh_every=0), 'LazyMAR.refresh_every'), (dict(ratios=(1.2,)), 'LazyMAR.ratios'),
    (dict(head_warm=2.0), 'LazyMAR.head_warm'), (dict(head_skip=(1, 1)), 'LazyMAR.head_skip'),
    (dict(decoder_sizes=0), 'LazyMAR.decoder_sizes'), (dict(decoder_sizes='one'), 'LazyMAR.decoder_sizes'),
])
def test_bad_settings_name_their_field(settings, message):
  with pytest.raises(ValueError, match=message):
    LazyMAR(**settings)


def test_unknown_preset_lists_the_known_ones():
  with pytest.raises(ValueError, match="unknown LazyMAR preset 'fast'.*official"):
    LazyMAR.preset('fast')


def test_sampler_rejects_bad_orders_and_noises_before_compiling(params):
  sample = make_mar_sampler(CFG, VAE_CFG, num_iter=2)
  with pytest.raises(ValueError, match='orders must be one permutation'):
    sample(params, jax.random.key(0), LABELS, cfg=2.0, orders=np.zeros((2, CFG.seq_len), int))
  with pytest.raises(ValueError, match='noises must be'):
    sample(params, jax.random.key(0), LABELS, cfg=2.0, noises={'init': np.zeros(3)})
  assert sample._jitted._cache_size() == 0
