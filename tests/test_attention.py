"""var_models.nn.attention against a float64 NumPy softmax reference, and the KV cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from var_models.nn import attention as attn_mod
from var_models.nn.attention import KVCache, ScaleCausal, TokenMask, attention
from var_models.var.schedules import ScaleSchedule

RTOL = 1e-5
ATOL = 1e-5
on_gpu = pytest.mark.skipif(jax.default_backend() != 'gpu', reason='cudnn backend needs a GPU')


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
  # The float64 reference checks float32 arithmetic; on GPU, XLA's default
  # float32 matmul precision is TF32 (~1e-3 relative), so ask for full float32.
  # (On CPU this changes nothing.) The bf16 cudnn test is unaffected.
  with jax.default_matmul_precision('highest'):
    yield


def _qkv(b=2, lq=14, lk=14, h=3, d=8, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, lq, h, d)).astype(dtype)
  k = rng.standard_normal((b, lk, h, d)).astype(dtype)
  v = rng.standard_normal((b, lk, h, d)).astype(dtype)
  return q, k, v


def ref_attention(q, k, v, mask=None, scale=None):
  """float64 softmax(scale * q.k^T, masked) v; q [B, Lq, H, D], mask -> [B, H, Lq, Lk]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  if scale is None:
    scale = 1.0 / np.sqrt(q.shape[-1])
  logits = np.einsum('bqhd,bkhd->bhqk', q, k) * scale
  if mask is not None:
    mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    assert mask.any(-1).all(), 'reference needs every query to see at least one key'
    logits = np.where(mask, logits, -np.inf)
  logits = logits - logits.max(-1, keepdims=True)
  p = np.exp(logits)
  p = p / p.sum(-1, keepdims=True)
  return np.einsum('bhqk,bkhd->bqhd', p, v)


def _close(got, want, rtol=RTOL, atol=ATOL):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)


SCHED = ScaleSchedule((1, 2, 3))  # L = 1 + 4 + 9 = 14
LEVELS = SCHED.level_ids()


# --------------------------------------------------------------------------- masks
def test_no_mask_matches_reference():
  q, k, v = _qkv()
  out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  assert out.shape == q.shape and out.dtype == jnp.float32
  _close(out, ref_attention(q, k, v))


def test_scale_causal_dense_is_block_lower_triangular():
  dense = ScaleCausal(LEVELS, LEVELS).dense()
  assert dense.shape == (1, 1, 14, 14) and dense.dtype == bool
  # Token 0 (scale 0) sees only itself; scale-1 tokens 1..4 see 0..4; scale-2 sees all.
  np.testing.assert_array_equal(dense[0, 0, 0], np.arange(14) < 1)
  for i in range(1, 5):
    np.testing.assert_array_equal(dense[0, 0, i], np.arange(14) < 5)
  assert dense[0, 0, 5:].all()


def test_scale_causal_matches_masked_reference():
  q, k, v = _qkv(seed=1)
  mask = LEVELS[:, None] >= LEVELS[None, :]
  out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=ScaleCausal(LEVELS, LEVELS))
  _close(out, ref_attention(q, k, v, mask))
  # The mask must matter: unmasked attention differs on the first two scales.
  unmasked = ref_attention(q, k, v)
  assert np.abs(np.asarray(out)[:, :5] - unmasked[:, :5]).max() > 1e-2
  # ...and the last scale sees everything, so it equals unmasked there.
  _close(np.asarray(out)[:, 5:], unmasked[:, 5:])


def test_token_mask_full_shape_matches_reference():
  b, h, lq, lk = 2, 3, 6, 10
  q, k, v = _qkv(b=b, lq=lq, lk=lk, h=h, seed=2)
  rng = np.random.default_rng(3)
  mask = rng.random((b, h, lq, lk)) < 0.5
  mask[..., 0] = True  # every query sees at least one key
  out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=TokenMask(jnp.asarray(mask)))
  _close(out, ref_attention(q, k, v, mask))
  assert np.abs(np.asarray(out) - ref_attention(q, k, v)).max() > 1e-2


def test_token_mask_broadcast_numpy_mask_matches_reference():
  q, k, v = _qkv(lq=5, lk=7, seed=4)
  mask = np.tril(np.ones((5, 7), bool), k=2)[None, None]  # [1, 1, Lq, Lk]
  out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=TokenMask(mask))
  _close(out, ref_attention(q, k, v, mask))


def test_token_mask_equal_to_scale_causal_gives_same_output():
  q, k, v = (jnp.asarray(a) for a in _qkv(seed=5))
  sc = ScaleCausal(LEVELS, LEVELS)
  a = attention(q, k, v, mask=sc)
  b = attention(q, k, v, mask=TokenMask(sc.dense()))
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- scale, shapes
def test_default_scale_is_inverse_sqrt_head_dim():
  q, k, v = _qkv(d=16, seed=6)
  out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  _close(out, ref_attention(q, k, v, scale=0.25))


@pytest.mark.parametrize('scale', [1.0, 0.05, 2.5])
def test_custom_scale_matches_reference(scale):
  q, k, v = _qkv(seed=7)
  out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=scale)
  _close(out, ref_attention(q, k, v, scale=scale))
  # A different scale must give a different answer than the default.
  assert np.abs(np.asarray(out) - ref_attention(q, k, v)).max() > 1e-3


def test_lq_different_from_lk_with_scale_causal():
  # Queries of the last scale (9 tokens) against the first two scales plus itself.
  q, k, v = _qkv(lq=9, lk=14, seed=8)
  q_levels = LEVELS[5:]
  out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=ScaleCausal(q_levels, LEVELS))
  assert out.shape == (2, 9, 3, 8)
  _close(out, ref_attention(q, k, v, q_levels[:, None] >= LEVELS[None, :]))


def test_lq_different_from_lk_no_mask():
  q, k, v = _qkv(lq=3, lk=11, seed=9)
  out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  assert out.shape == (2, 3, 3, 8)
  _close(out, ref_attention(q, k, v))


def test_attention_under_jit():
  q, k, v = (jnp.asarray(a) for a in _qkv(seed=10))
  mask = ScaleCausal(LEVELS, LEVELS)
  out = jax.jit(lambda q, k, v: attention(q, k, v, mask=mask))(q, k, v)
  _close(out, ref_attention(q, k, v, LEVELS[:, None] >= LEVELS[None, :]))


def test_unknown_backend_raises_value_error_naming_it():
  q, k, v = (jnp.asarray(a) for a in _qkv())
  with pytest.raises(ValueError, match="'flash9000'"):
    attention(q, k, v, backend='flash9000')
  with pytest.raises(ValueError, match="'flash9000'"):
    attn_mod.check_backend('flash9000')


@pytest.mark.parametrize('shapes', [
    ((2, 14, 3), (2, 14, 3, 8), (2, 14, 3, 8)),      # q not 4-D
    ((2, 14, 3, 8), (2, 14, 3, 8), (2, 13, 3, 8)),   # k != v
    ((2, 14, 3, 8), (2, 14, 3, 4), (2, 14, 3, 4)),   # head dim differs
    ((2, 14, 3, 8), (2, 14, 2, 8), (2, 14, 2, 8)),   # heads differ
    ((2, 14, 3, 8), (1, 14, 3, 8), (1, 14, 3, 8)),   # batch differs
])
def test_mismatched_shapes_raise_value_error(shapes):
  q, k, v = (jnp.ones(s, jnp.float32) for s in shapes)
  with pytest.raises(ValueError):
    attention(q, k, v)


def test_scale_causal_length_mismatch_raises_value_error():
  q, k, v = (jnp.asarray(a) for a in _qkv(lq=14, lk=14))
  with pytest.raises(ValueError, match='ScaleCausal'):
    attention(q, k, v, mask=ScaleCausal(LEVELS[:5], LEVELS))
  with pytest.raises(ValueError, match='ScaleCausal'):
    attention(q, k, v, mask=ScaleCausal(LEVELS, LEVELS[:5]))


def test_register_backend_is_dispatched_with_mask_and_scale(monkeypatch):
  monkeypatch.setattr(attn_mod, '_BACKENDS', dict(attn_mod._BACKENDS))
  seen = {}

  def fake(q, k, v, mask, scale, kv_len):
    seen.update(mask=mask, scale=scale, kv_len=kv_len)
    return attn_mod._BACKENDS['xla'](q, k, v, mask, scale, kv_len)

  attn_mod.register_backend('fake', fake)
  assert 'fake' in attn_mod.backends()
  q, k, v = _qkv(d=4, seed=11)
  mask = ScaleCausal(LEVELS, LEVELS)
  out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=mask, backend='fake')
  assert seen['mask'] is mask and seen['scale'] == pytest.approx(0.5) and seen['kv_len'] is None
  _close(out, ref_attention(q, k, v, mask.dense()))


def test_kv_len_reads_only_the_first_keys():
  q, k, v = _qkv(d=4, seed=12)
  n = k.shape[1] - 3
  poisoned_k, poisoned_v = k.copy(), v.copy()
  poisoned_k[:, n:], poisoned_v[:, n:] = 1e3, -1e3  # finite: 0 * NaN would poison any backend
  out = attention(jnp.asarray(q), jnp.asarray(poisoned_k), jnp.asarray(poisoned_v), kv_len=n)
  _close(out, ref_attention(q, k[:, :n], v[:, :n]))


@pytest.mark.parametrize('kv_len', [0, 10**6])
def test_kv_len_out_of_range_raises(kv_len):
  q, k, v = _qkv(d=4, seed=13)
  with pytest.raises(ValueError, match='kv_len must be in'):
    attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), kv_len=kv_len)


# --------------------------------------------------------------------------- KV cache
def _full_scale_causal(q, k, v):
  return attention(q, k, v, mask=ScaleCausal(LEVELS, LEVELS))


@pytest.mark.parametrize('use_level_mask', [False, True])
def test_kv_cache_scale_by_scale_equals_full_scale_causal_rows(use_level_mask):
  # The KV-cache sampler's invariant: at scale s, queries of s attending to the
  # cached keys of scales 0..s equal the rows of s in full ScaleCausal attention.
  b, h, d = 2, 3, 8
  q, k, v = (jnp.asarray(a) for a in _qkv(b=b, h=h, d=d, seed=12))
  full = np.asarray(_full_scale_causal(q, k, v))
  want = ref_attention(q, k, v, LEVELS[:, None] >= LEVELS[None, :])
  _close(full, want)
  cache = KVCache.create(b, SCHED.L, h, d, jnp.float32)
  assert cache.capacity == SCHED.L and cache.length == 0 and cache.keys().shape == (b, 0, h, d)
  for s, (beg, end) in enumerate(SCHED.begin_ends):
    cache = cache.append(k[:, beg:end], v[:, beg:end])
    assert cache.length == end
    np.testing.assert_array_equal(np.asarray(cache.keys()), np.asarray(k[:, :end]))
    np.testing.assert_array_equal(np.asarray(cache.values()), np.asarray(v[:, :end]))
    mask = ScaleCausal(LEVELS[beg:end], LEVELS[:end]) if use_level_mask else None
    out = attention(q[:, beg:end], cache.keys(), cache.values(), mask=mask)
    np.testing.assert_allclose(np.asarray(out), full[:, beg:end], rtol=1e-5, atol=1e-6,
                               err_msg=f'scale {s}')
    _close(out, want[:, beg:end])


def test_kv_cache_loop_under_jit_equals_full_scale_causal():
  b, h, d = 2, 3, 8
  q, k, v = (jnp.asarray(a) for a in _qkv(b=b, h=h, d=d, seed=13))

  @jax.jit
  def sample_like(q, k, v):
    cache = KVCache.create(b, SCHED.L, h, d, jnp.float32)
    outs = []
    for beg, end in SCHED.begin_ends:
      cache = cache.append(k[:, beg:end], v[:, beg:end])
      outs.append(attention(q[:, beg:end], cache.keys(), cache.values()))
    return jnp.concatenate(outs, axis=1), cache

  out, cache = sample_like(q, k, v)
  assert cache.length == SCHED.L
  _close(out, ref_attention(q, k, v, LEVELS[:, None] >= LEVELS[None, :]))


def test_kv_cache_is_a_pytree_with_static_length():
  cache = KVCache.create(1, 6, 2, 4, jnp.float32).append(jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 2, 4)))
  leaves, treedef = jax.tree_util.tree_flatten(cache)
  assert len(leaves) == 2  # k and v; length is static metadata
  again = jax.tree_util.tree_unflatten(treedef, leaves)
  assert again.length == 2


def test_kv_cache_create_many_gives_independent_zero_caches():
  @jax.jit
  def fill(k):
    caches = KVCache.create_many(3, 2, 5, 2, 4, jnp.bfloat16)
    return [c.append(k * (i + 1), -k) for i, c in enumerate(caches)]

  caches = fill(jnp.ones((2, 2, 2, 4), jnp.float32))
  assert len(caches) == 3
  for i, c in enumerate(caches):
    assert c.k.shape == c.v.shape == (2, 5, 2, 4) and c.k.dtype == jnp.bfloat16 and c.length == 2
    np.testing.assert_array_equal(np.asarray(c.keys(), np.float32), i + 1.0)
    np.testing.assert_array_equal(np.asarray(c.values(), np.float32), -1.0)
    np.testing.assert_array_equal(np.asarray(c.k[:, 2:], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(c.v[:, 2:], np.float32), 0.0)


def test_kv_cache_casts_appended_values_to_cache_dtype():
  cache = KVCache.create(1, 4, 1, 2, jnp.bfloat16)
  cache = cache.append(jnp.full((1, 3, 1, 2), 1.5, jnp.float32), jnp.full((1, 3, 1, 2), -2.0, jnp.float32))
  assert cache.keys().dtype == jnp.bfloat16 and cache.keys().shape == (1, 3, 1, 2)
  np.testing.assert_array_equal(np.asarray(cache.values(), np.float32), -2.0)


def test_kv_cache_overflow_raises_value_error():
  cache = KVCache.create(1, 5, 2, 4, jnp.float32)
  chunk = jnp.ones((1, 3, 2, 4))
  cache = cache.append(chunk, chunk)
  with pytest.raises(ValueError, match='overflow'):
    cache.append(chunk, chunk)
  # Filling exactly to capacity is fine.
  full = cache.append(chunk[:, :2], chunk[:, :2])
  assert full.length == 5


@pytest.mark.parametrize('d,dtype', [(512, jnp.bfloat16), (12, jnp.bfloat16), (64, jnp.float32)])
def test_cudnn_hands_what_it_refuses_to_xla(d, dtype):
  # A VAE's one-head mid attention (head dim 512), head dims off the multiple of 8, float32:
  # cuDNN's flash attention takes none of them; on any device these run through xla.
  q, k, v = (jnp.asarray(a, dtype) for a in _qkv(b=1, lq=9, lk=9, h=1, d=d, seed=15))
  np.testing.assert_array_equal(np.asarray(attention(q, k, v, backend='cudnn'), np.float32),
                                np.asarray(attention(q, k, v, backend='xla'), np.float32))


# --------------------------------------------------------------------------- cudnn (GPU only)
@on_gpu
@pytest.mark.parametrize('masked', [False, True])
def test_cudnn_matches_xla_in_bf16(masked):
  sched = ScaleSchedule((1, 2, 3, 4, 5))  # L = 55
  lv = sched.level_ids()
  q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in _qkv(b=2, lq=sched.L, lk=sched.L, h=4, d=64, seed=14))
  mask = ScaleCausal(lv, lv) if masked else None
  x = attention(q, k, v, mask=mask, backend='xla')
  c = attention(q, k, v, mask=mask, backend='cudnn')
  assert c.dtype == jnp.bfloat16 and c.shape == q.shape
  np.testing.assert_allclose(np.asarray(c, np.float32), np.asarray(x, np.float32), atol=2e-2, rtol=2e-2)
  want = ref_attention(np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32),
                       None if mask is None else mask.dense())
  np.testing.assert_allclose(np.asarray(c, np.float64), want, atol=3e-2, rtol=3e-2)


def test_attention_dropout_keeps_expectation_and_is_off_without_rng():
  q, k, v = _qkv(b=1, lq=6, lk=40, h=2, d=4, seed=14)
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  plain = attention(q, k, v)
  _close(attention(q, k, v, dropout_rate=0.5), ref_attention(q, k, v))
  outs = jnp.stack([attention(q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(i)) for i in range(300)])
  assert not np.allclose(outs[0], outs[1])
  np.testing.assert_allclose(outs.mean(0), plain, atol=0.15)
