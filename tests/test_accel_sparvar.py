"""SparVAR: appendix A.2's index mapping, CS4A against a NumPy transcription of the paper's
equations, CSLA's layout against a per-token loop and the paper's sparsities, CSLA through the
sampler, and settings checked before anything compiles."""
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from accel.sparvar import (PRESETS, CS4AHooks, SparVAR, add_upsampled, csla_layout, dense_with_column_sums,
                           group_map, key_map, with_sink)
from pallas_kernels.layout import EMPTY, PARTIAL
from var_models.var.model import VARConfig
from var_models.var.policy import var_binding
from var_models.var.schedules import INFINITY_1024, ScaleSchedule

PNS = (1, 2, 3, 4, 6, 8)


def _binding(sched, depth):
  """What the sampler of a depth-block VAR on sched binds its policy to."""
  return var_binding(VARConfig(depth=depth, patch_nums=sched.patch_nums))


def test_key_map_moves_each_key_by_the_scale_offset_and_floors_its_grid_position():
  # Scale 0's token -> scale 1's first; scale 1's 2x2 -> the top-left of each 2x2 cell of 4x4.
  np.testing.assert_array_equal(key_map((1, 2, 4), 1, 2), [1, 5, 7, 13, 15])
  # Onto its own scale, the identity.
  np.testing.assert_array_equal(key_map(PNS, 3, 3), np.arange(30))
  # 3x3 -> 4x4: (u, v) -> (floor(4u / 3), floor(4v / 3)) = rows/cols 0, 1, 2.
  m = key_map((1, 3, 4), 1, 2)
  np.testing.assert_array_equal(m[1:], 10 + np.array([0, 1, 2, 4, 5, 6, 8, 9, 10]))


def test_group_map_is_the_homography_with_half_to_even_rounding_and_clipping():
  np.testing.assert_array_equal(group_map(5, 5), np.arange(5))
  np.testing.assert_array_equal(group_map(2, 4), [0, 0, 1, 1])       # (g + .5) / 2 - .5 = -.25, .25, .75, 1.25
  np.testing.assert_array_equal(group_map(3, 2), [0, 2])             # .25 -> 0, 1.75 -> 2
  assert group_map(9, 22).min() == 0 and group_map(9, 22).max() == 8


def test_with_sink_unites_and_pads_the_duplicates():
  top = jnp.array([[[[5, 1, 7]]]])
  np.testing.assert_array_equal(with_sink(top, 3), [[[[0, 1, 2, 5, -1, 7]]]])


def test_dense_with_column_sums_sums_the_probabilities_of_each_query_group():
  key = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (1, 10, 2, 16)) for kk in key)
  out, sums = dense_with_column_sums(q, k, v, 7, 0.25, 4)
  s = np.einsum('bqhd,bkhd->bhqk', np.asarray(q), np.asarray(k)[:, :7]) * 0.25
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(out, np.einsum('bhqk,bkhd->bqhd', p, np.asarray(v)[:, :7]), rtol=1e-5, atol=1e-6)
  want = np.stack([p[:, :, :4].sum(2), p[:, :, 4:8].sum(2), p[:, :, 8:].sum(2)], axis=2)
  np.testing.assert_allclose(sums, want, rtol=1e-5)


@pytest.mark.parametrize('src, dst', [(3, 3), (4, 6), (10, 13), (40, 64)])
@pytest.mark.parametrize('method', ['linear', 'nearest'])
def test_add_upsampled_adds_what_jax_image_resize_gives(src, dst, method):
  cache = jax.random.normal(jax.random.key(0), (2, src * src, 3, 4))
  x = jax.random.normal(jax.random.key(1), (2, dst * dst, 3, 4)).astype(jnp.bfloat16)
  grid = jax.image.resize(cache.reshape(2, src, src, 12), (2, dst, dst, 12), method, antialias=False)
  want = (x.astype(jnp.float32) + grid.reshape(x.shape)).astype(jnp.bfloat16)
  got = add_upsampled(x, cache, src, dst, method)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(add_upsampled(x.astype(jnp.float32), cache, src, dst, method),
                             x.astype(jnp.float32) + grid.reshape(x.shape), rtol=1e-5, atol=2e-5)


def _numpy_cs4a(q_s, k_s, v_s, q_k, k_k, v_k, policy, s, kk, scale):
  """The paper's CS4A, restated in NumPy: decision-scale column sums and top-k, A.2's mapping,
  O = bilinear(O_dense - O_sparse at S) + sparse attention at K (the sink included)."""
  pns, c = policy.patch_nums, policy.group
  n_s, n_k = pns[s] ** 2, pns[kk] ** 2
  ks_len, kk_len = sum(p * p for p in pns[:s + 1]), sum(p * p for p in pns[:kk + 1])
  sink = sum(p * p for p in pns[:policy.sink_scales])

  def attend(q, k, v, keys):   # q [n, H, D] of one group over a key list per head
    out = np.zeros(q.shape)
    for h in range(q.shape[1]):
      lg = q[:, h] @ k[keys[h], h].T * scale
      p = np.exp(lg - lg.max(-1, keepdims=True))
      out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[keys[h], h]
    return out

  lg = np.einsum('qhd,khd->hqk', q_s, k_s[:ks_len]) * scale
  p = np.exp(lg - lg.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  dense = np.einsum('hqk,khd->qhd', p, v_s[:ks_len])
  g_s, g_k = -(-n_s // c), -(-n_k // c)
  tops, cache = [], np.zeros_like(dense)
  for g in range(g_s):
    rows = slice(g * c, (g + 1) * c)
    top = [np.argsort(-p[h, rows].sum(0), kind='stable')[:policy.top_count] for h in range(p.shape[0])]
    tops.append(top)
    keys = [np.union1d(np.arange(sink), t) for t in top]
    cache[rows] = dense[rows] - attend(q_s[rows], k_s, v_s, keys)
  table = key_map(pns, s, kk)
  out = np.zeros(q_k.shape)
  for g in range(g_k):
    src = int(np.clip(np.rint((g + 0.5) / g_k * g_s - 0.5), 0, g_s - 1))
    keys = [np.union1d(np.arange(sink), table[t]) for t in tops[src]]
    assert all(kk_len > k.max() for k in keys)
    rows = slice(g * c, (g + 1) * c)
    out[rows] = attend(q_k[rows], k_k, v_k, keys)
  up = jax.image.resize(cache.reshape(pns[s], pns[s], -1), (pns[kk], pns[kk], cache[0].size), 'linear')
  return out + np.asarray(up).reshape(out.shape)


@pytest.mark.parametrize('impl', ['reference', 'interpret'])
def test_cs4a_hooks_compute_the_papers_equations(impl):
  policy = SparVAR(decision=4, sparse=(6, 8), group=16, sink_scales=2, topk=0.3).bind(_binding(ScaleSchedule(PNS), 2))
  s, kk = PNS.index(4), PNS.index(8)
  cap = sum(p * p for p in PNS)
  keys = jax.random.split(jax.random.key(1), 6)
  q_s, q_k = (jax.random.normal(keys[i], (1, n, 2, 16)) for i, n in ((0, 16), (1, 64)))
  k_buf, v_buf = (jax.random.normal(keys[i], (1, cap, 2, 16)) for i in (2, 3))
  with pk.override(impl) if impl != 'reference' else contextlib.nullcontext():
    out_s, state = CS4AHooks('0', policy, s).attend(q_s, k_buf, v_buf, mask=None, kv_len=30, scale=0.25,
                                                    backend='xla', state={})
    out_k, _ = CS4AHooks('0', policy, kk).attend(q_k, k_buf, v_buf, mask=None, kv_len=cap, scale=0.25,
                                                 backend='xla', state=state)
  assert state['0/top'].shape == (1, 2, 1, policy.top_count) and policy.top_count == 9
  want = _numpy_cs4a(*(np.asarray(a[0], np.float64) for a in (q_s, k_buf, v_buf, q_k, k_buf, v_buf)),
                     policy, s, kk, 0.25)
  np.testing.assert_allclose(out_k[0], want, rtol=2e-4, atol=2e-5)
  # At S the block's own output is the dense one.
  np.testing.assert_allclose(out_s, dense_with_column_sums(q_s, k_buf, v_buf, 30, 0.25, 16)[0], rtol=1e-5, atol=1e-6)


def test_selecting_every_key_at_the_decision_scale_leaves_no_o_cache():
  """O_cache = O_dense - attention over the selected keys: with every key selected it vanishes."""
  policy = SparVAR(decision=4, sparse=(6,), group=16, sink_scales=2, topk=1.0).bind(_binding(ScaleSchedule(PNS), 1))
  keys = jax.random.split(jax.random.key(2), 3)
  q = jax.random.normal(keys[0], (2, 16, 2, 16))
  k, v = (jax.random.normal(kk, (2, 130, 2, 16)) for kk in keys[1:])
  out, state = CS4AHooks('0', policy, PNS.index(4)).attend(q, k, v, mask=None, kv_len=30, scale=0.25,
                                                          backend='xla', state={})
  assert policy.top_count == 30
  np.testing.assert_allclose(state['0/cache'], 0.0, atol=2e-6)
  assert float(jnp.abs(out).max()) > 0.1


def test_without_o_cache_the_decision_scale_keeps_only_the_top_keys():
  policy = SparVAR(decision=4, sparse=(6,), group=16, sink_scales=2, cache=False).bind(_binding(ScaleSchedule(PNS), 1))
  q, k, v = (jax.random.normal(kk, (2, n, 2, 16)) for kk, n in zip(jax.random.split(jax.random.key(3), 3),
                                                                    (16, 130, 130)))
  _, state = CS4AHooks('0', policy, PNS.index(4)).attend(q, k, v, mask=None, kv_len=30, scale=0.25,
                                                        backend='xla', state={})
  assert set(state) == {'0/top'}



def _csla_token_mask(patch_nums, sink_scales, windows):
  """Per-token loop of SparVAR's CSLA mask for the last scale's queries."""
  offsets = np.concatenate([[0], np.cumsum([p * p for p in patch_nums])])
  side = patch_nums[-1]
  first = len(patch_nums) - len(windows)
  out = np.zeros((side * side, offsets[-1]), bool)
  for i in range(side * side):
    out[i, :offsets[sink_scales]] = True
    for w, h in zip(windows, range(first, len(patch_nums))):
      pn = patch_nums[h]
      cy, cx = round(i // side / side * pn), round(i % side / side * pn)
      for j in range(pn * pn):
        if abs(j // pn - cy) <= w // 2 and abs(j % pn - cx) <= w // 2:
          out[i, offsets[h] + j] = True
  return out


def test_csla_token_layout_matches_per_token_definition():
  patch_nums = (1, 2, 4, 6, 8)
  layout = csla_layout(patch_nums, sink_scales=2, windows=(1, 3, 5), block_q=16, block_k=16,
                       block_wise=False)
  want = _csla_token_mask(patch_nums, 2, (1, 3, 5))
  assert (layout.lq, layout.lk) == want.shape == (64, 121)
  np.testing.assert_array_equal(layout.dense()[0], want)


def test_csla_block_wise_layout_computes_whole_tiles_covering_the_token_mask():
  patch_nums = (1, 2, 4, 6, 8)
  token = csla_layout(patch_nums, sink_scales=2, windows=(1, 3, 5), block_q=16, block_k=16,
                      block_wise=False)
  blocks = csla_layout(patch_nums, sink_scales=2, windows=(1, 3, 5), block_q=16, block_k=16)
  assert (blocks.dense() >= token.dense()).all()
  np.testing.assert_array_equal(blocks.kinds() != EMPTY, token.kinds() != EMPTY)
  # Only the key tail (121 = 7 * 16 + 9) is partial in the block-wise layout.
  partial_cols = np.flatnonzero((blocks.kinds() == PARTIAL).any((0, 1)))
  np.testing.assert_array_equal(partial_cols, [7])
  assert 0 < pk.layout_density(blocks) < 1


def _flex_sparsity(layout):
  """SparVAR's figure: FlexAttention's BlockMask.sparsity(), whole tiles over Lq * Lk tokens."""
  tiles = layout.kv_count.sum() * layout.block_q * layout.block_k
  return 100 * (1 - tiles / (layout.lq * layout.lk))


def test_csla_block_sparsity_at_the_papers_last_scale():
  text = csla_layout(INFINITY_1024.patch_nums)
  fit = csla_layout(INFINITY_1024.patch_nums, point_windows=2)
  assert (text.lq, text.lk, text.num_q_blocks, text.num_k_blocks) == (4096, 10521, 32, 83)
  assert (text.kv_count.sum(), fit.kv_count.sum()) == (355, 435)
  assert pk.layout_density(text) == 355 / 2656 and pk.layout_density(fit) == 435 / 2656
  assert (round(_flex_sparsity(text), 2), round(_flex_sparsity(fit), 2)) == (86.50, 83.46)
  assert (fit.dense() >= text.dense()).all()


@pytest.mark.parametrize('sink_scales, windows, table4', [
    (5, (1, 3, 5), 86.24), (5, (3, 3, 3), 86.77), (5, (3, 5, 7), 83.46), (5, (5, 5, 5), 83.77),
    (5, (5, 7, 9), 80.72), (5, (7, 7, 7), 81.18), (5, (7, 9, 11), 78.06), (6, (3, 5, 7), 81.03),
    (7, (3, 5, 7), 78.60), (8, (3, 5, 7), 75.21), (0, (3, 5, 7), 84.68)])
def test_csla_point_windows_reproduce_sparvar_table4(sink_scales, windows, table4):
  # The token layout has the block-wise one's tiles (test above) and builds faster.
  layout = csla_layout(INFINITY_1024.patch_nums, sink_scales=sink_scales, windows=windows,
                       point_windows=2, block_wise=False)
  assert round(_flex_sparsity(layout), 2) == table4


@pytest.mark.parametrize('call, match', [
    (lambda: csla_layout((1, 2, 4), sink_scales=4), 'sink_scales'),
    (lambda: csla_layout((1, 2, 4), sink_scales=1, windows=(3, 5, 7, 9)), 'windows'),
    (lambda: csla_layout((1, 2, 4), sink_scales=1, point_windows=-1), 'point_windows'),
    (lambda: csla_layout((1, 2, 4), sink_scales=1, point_windows=1), 'windows'),
])
def test_bad_csla_layout_arguments_raise_clear_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_csla_whose_windows_cover_every_key_reproduces_the_baseline(sample_tiny):
  images, aux = sample_tiny()
  covering = SparVAR(decision=3, sparse=(4,), group=16, sink_scales=1, cs4a_layers=0.0, windows=(9, 9, 9),
                     block=16)
  with pk.override('interpret'):
    sparse, sparse_aux = sample_tiny(covering)
  for a, b in zip(sparse_aux['indices'], aux['indices']):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(sparse, images, atol=1e-5)


def test_sparvar_sampler_keeps_the_scales_up_to_the_decision_scale_and_changes_the_sparse_ones(sample_tiny):
  """CS4A in block 0 and CSLA in block 1 at the last scale, on the interpret-mode kernels."""
  _, aux = sample_tiny()
  policy = SparVAR(decision=3, sparse=(4,), group=16, sink_scales=1, topk=0.3, cs4a_layers=0.5,
                   windows=(1, 1, 3), block=16)
  with pk.override('interpret'):
    images, sparse_aux = sample_tiny(policy)
  assert np.isfinite(np.asarray(images)).all()
  for si in range(3):
    np.testing.assert_array_equal(sparse_aux['indices'][si], aux['indices'][si])
  assert (np.asarray(sparse_aux['indices'][3]) != np.asarray(aux['indices'][3])).any()


def test_sparvar_composes_with_fastvars_trailing_skip(sample_tiny):
  """The skip-2 setting in small: FastVAR skips the last scale, SparVAR sparsifies the one before."""
  from accel import FastVAR, compose
  sparvar = SparVAR(decision=2, sparse=(3,), group=16, sink_scales=1, windows=(1, 3), block=16)
  _, aux = sample_tiny()
  with pk.override('interpret'):
    images, skip_aux = sample_tiny(compose(FastVAR(ratios=((4, 1.0),)), sparvar))
    _, sparse_aux = sample_tiny(sparvar)
  assert np.isfinite(np.asarray(images)).all() and len(skip_aux['indices']) == 3
  for si in range(2):
    np.testing.assert_array_equal(skip_aux['indices'][si], aux['indices'][si])
  # The sparse scale is SparVAR's, not the baseline's.
  np.testing.assert_array_equal(skip_aux['indices'][2], sparse_aux['indices'][2])
  assert (np.asarray(skip_aux['indices'][2]) != np.asarray(aux['indices'][2])).any()


@pytest.mark.parametrize('pgd, message', [(True, 'one scale per step'), (False, 'need the whole scale')])
def test_sparvar_with_a_policy_that_prunes_its_scales_is_an_error_naming_why(sample_tiny, pgd, message):
  """LazyVAR forwards a few tokens of the scales SparVAR would sparsify (or runs them as one step)."""
  from accel import LazyVAR, compose
  sparvar = SparVAR(decision=2, sparse=(3,), group=16, sink_scales=1, windows=(1, 3), block=16)
  with pytest.raises(ValueError, match=message), pk.override('interpret'):
    sample_tiny(compose(LazyVAR(start=2, retention=(0.5, 0.5), pgd=pgd), sparvar))


def test_the_sparse_attention_calls_read_the_kv_buffer_in_place(sample_tiny):
  """Every sparse call gets the whole cache buffer (capacity 30) with its valid length, no copy."""
  from var_models.nn import attention
  calls = []
  real = attention._sparse

  def record(q, k, v, mask, scale, kv_len):
    calls.append((type(mask).__name__, q.shape[1], k.shape[1], kv_len))
    return real(q, k, v, mask, scale, kv_len)

  policy = SparVAR(decision=3, sparse=(4,), group=16, sink_scales=1, cs4a_layers=0.5, windows=(1, 1, 3),
                   block=16)
  attention._sparse = record
  try:
    sample_tiny(policy)
  finally:
    attention._sparse = real
  assert calls == [('GatheredKeys', 9, 30, 14), ('GatheredKeys', 16, 30, None), ('BlockSparse', 16, 30, None)]


@pytest.mark.parametrize('make,message', [
    (lambda: SparVAR(decision=40, sparse=(32,)), r'SparVAR.sparse: sides \(32,\) must be'),
    (lambda: SparVAR(decision=40, sparse=(48,), topk=0.0), 'SparVAR.topk'),
    (lambda: SparVAR(decision=40, sparse=(48,), group=100), 'SparVAR.group'),
    (lambda: SparVAR(decision=40, sparse=(48,), cs4a_layers=1.5), 'SparVAR.cs4a_layers'),
    (lambda: SparVAR(decision=40, sparse=(48,), cache_upsample='bicubic'), 'SparVAR.cache_upsample'),
    (lambda: SparVAR(decision=41, sparse=(48,)).bind(_binding(INFINITY_1024, 4)), r'SparVAR.decision: scales \[41\]'),
    (lambda: SparVAR(decision=2, sparse=(4,), sink_scales=3).bind(_binding(INFINITY_1024, 4)), 'SparVAR.sink_scales'),
    (lambda: SparVAR(decision=40, sparse=(48,), windows=(3, 0, 7)).bind(_binding(INFINITY_1024, 4)), 'windows'),
])
def test_bad_settings_are_errors_naming_the_field_before_anything_compiles(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_presets_bind_to_their_schedules_with_the_papers_counts():
  var256 = ScaleSchedule((1, 2, 3, 4, 5, 6, 8, 10, 13, 16))
  for name in PRESETS:
    sched = var256 if name.startswith('var256') else INFINITY_1024
    SparVAR.preset(name).bind(_binding(sched, 30))
  p = SparVAR.preset('infinity_2b').bind(_binding(INFINITY_1024, 32))
  assert (p.sink_len, p.top_count, p.cs4a_count(32), p.cs4a_count(40)) == (121, 824, 19, 24)
  assert SparVAR.preset('skip2').bind(_binding(INFINITY_1024, 32)).top_count == int(0.2 * 2521)
  assert dataclasses.replace(p, cs4a_layers=1.0).cs4a_count(32) == 32
