"""Column sums of attention probabilities per query group (Pallas, interpret mode) against
their float64 reference and against explicit softmax probabilities.

Interpret mode fills outputs with NaN before the kernel runs
(tests/test_pallas_attention.py checks it), so an element the kernel fails to
write fails the comparison.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import group_column_sums, masked_attention, reference

B, H, D = 2, 2, 16
SCALE = 1 / np.sqrt(D)


def _qk(seed, lq, lk, dtype=jnp.float32, d=D):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal((B, n, H, d)), dtype) for n in (lq, lk))


def _lse(q, k, kv_len, scale=SCALE):
  """The true log-sum-exp [B, H, Lq] float32 of each query row over the first kv_len keys."""
  _, lse = masked_attention(q.astype(jnp.float32), k[:, :kv_len].astype(jnp.float32),
                            k[:, :kv_len].astype(jnp.float32),
                            np.ones((1, q.shape[1], kv_len), bool), scale)
  return lse.astype(jnp.float32)


def _ref(q, k, lse, group, kv_len, scale=SCALE):
  """float64 reference on the same (possibly bf16-rounded) inputs."""
  with jax.enable_x64(True):
    q64, k64, lse64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, lse))
    return np.asarray(reference.group_column_sums(q64, k64, lse64, group, scale, kv_len))


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.isfinite(got).all(), 'kernel left unwritten (NaN) or non-finite elements'
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _spoil(k, kv_len, fill):
  return k.at[:, kv_len:].set(fill)


@pytest.mark.parametrize('dtype, tol', [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-4)])
@pytest.mark.parametrize('lq, group, block_q, block_k', [
    (40, 32, 16, 16),   # Lq: not a multiple of group or block_q; two sub-blocks per group
    (70, 48, 16, 32),   # three sub-blocks per group, the last group 22 rows
    (20, 64, None, 16),  # one partial group, default block_q 64 past Lq
])
def test_matches_reference_at_the_tails(dtype, tol, lq, group, block_q, block_k):
  lk, kv_len = 60, 41      # kv_len: not a multiple of block_k, < Lk
  q, k = _qk(0, lq, lk, dtype)
  lse = _lse(q, k, kv_len)
  got = group_column_sums(q, k, lse, group=group, kv_len=kv_len, impl='interpret',
                          block_q=block_q, block_k=block_k)
  want = _ref(q, k, lse, group, kv_len)
  assert got.shape == (B, H, -(-lq // group), kv_len) and got.dtype == jnp.float32
  assert _rel(got, want) < tol


@pytest.mark.parametrize('fill', [1e30, np.nan], ids=['huge', 'nan'])
def test_spare_kv_rows_past_kv_len_never_leak(fill):
  lq, lk, kv_len, group = 40, 60, 41, 32
  q, k = _qk(1, lq, lk)
  lse = _lse(q, k, kv_len)
  want = _ref(q, k, lse, group, kv_len)
  got = group_column_sums(q, _spoil(k, kv_len, fill), lse, group=group, kv_len=kv_len,
                          impl='interpret', block_q=16, block_k=16)
  assert _rel(got, want) < 2e-6


def test_each_group_sums_to_its_number_of_valid_queries():
  lq, lk, kv_len, group = 50, 64, 37, 16      # groups of 16, 16, 16 and 2 queries
  q, k = _qk(2, lq, lk)
  k = _spoil(k, kv_len, np.nan)
  lse = _lse(q, k, kv_len)
  for impl in ('interpret', 'reference'):
    sums = group_column_sums(q, k, lse, group=group, kv_len=kv_len, impl=impl, block_k=16)
    np.testing.assert_allclose(np.asarray(sums).sum(-1),
                               np.broadcast_to([16, 16, 16, 2], (B, H, 4)), rtol=1e-5)


def test_agrees_with_the_column_sums_of_explicit_softmax_probabilities():
  lq, lk, kv_len, group, scale = 36, 48, 48, 32, 0.3
  q, k = _qk(3, lq, lk)
  p = jax.nn.softmax(jnp.einsum('bqhd,bkhd->bhqk', q, k) * scale, axis=-1)
  want = jnp.stack([p[:, :, :32].sum(2), p[:, :, 32:].sum(2)], axis=2)
  lse = _lse(q, k, kv_len, scale)
  for impl in ('interpret', 'reference'):
    got = group_column_sums(q, k, lse, group=group, scale=scale, impl=impl, block_k=16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_rows_with_minus_inf_lse_contribute_nothing():
  lq, lk, group = 32, 40, 16
  q, k = _qk(4, lq, lk)
  lse = np.asarray(_lse(q, k, lk)).copy()
  lse[0, 1, 3:9] = -np.inf                    # six rows of batch 0, head 1: no key
  lse = jnp.asarray(lse)
  got = np.asarray(group_column_sums(q, k, lse, group=group, impl='interpret', block_k=16))
  assert _rel(got, _ref(q, k, lse, group, lk)) < 2e-6
  np.testing.assert_allclose(got[0, 1].sum(-1), [10, 16], rtol=1e-5)


@pytest.mark.parametrize('block_k, warps', [(64, 4), (128, 8), (256, 8), (32, 4)])
def test_lowers_to_triton_at_the_benchmark_shape(block_k, warps):
  """Triton IR on the CPU for the Infinity-2B decision scale (not compiled by Triton here)."""
  q = jax.ShapeDtypeStruct((2, 1600, 16, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 10521, 16, 128), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((2, 16, 1600), jnp.float32)
  f = lambda q, k, lse: group_column_sums(q, k, lse, group=192, kv_len=4121, impl='triton',
                                          block_k=block_k, num_warps=warps)
  text = jax.jit(f).trace(q, k, lse).lower(lowering_platforms=('cuda',)).as_text()
  assert 'group_column_sums' in text


def test_sparvar_dense_with_column_sums_runs_the_kernels_on_a_kv_buffer():
  """accel.sparvar's caller: the flash forward's lse feeding the kernel, on a buffer longer
  than the keys (zeros past kv_len, as a KV cache has), against explicit probabilities."""
  import pallas_kernels as pk
  from accel.sparvar import dense_with_column_sums
  lq, lk, kv_len, group, scale = 40, 80, 37, 16, 0.3
  q, k = _qk(5, lq, lk)
  v = _qk(6, lq, lk)[1]
  k, v = (x.at[:, kv_len:].set(0) for x in (k, v))
  p = jax.nn.softmax(jnp.einsum('bqhd,bkhd->bhqk', q, k[:, :kv_len]) * scale, axis=-1)
  want_out = jnp.einsum('bhqk,bkhd->bqhd', p, v[:, :kv_len])
  want = jnp.stack([p[:, :, i:i + group].sum(2) for i in range(0, lq, group)], axis=2)
  for impl in ('interpret', 'reference'):
    with pk.override(impl):
      out, sums = dense_with_column_sums(q, k, v, kv_len, scale, group)
    assert out.shape == q.shape and sums.shape == (B, H, 3, kv_len)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sums), np.asarray(want), rtol=1e-5, atol=1e-7)


def _args(lq=32, lk=40, d=D, dtype=jnp.float32):
  q = jnp.ones((B, lq, H, d), dtype)
  return q, jnp.ones((B, lk, H, d), dtype), jnp.zeros((B, H, lq), jnp.float32)


@pytest.mark.parametrize('call, match', [
    (lambda q, k, l: group_column_sums(q[0], k, l, group=16), 'expected q'),
    (lambda q, k, l: group_column_sums(q, k, l[0], group=16), 'expected q'),
    (lambda q, k, l: group_column_sums(q, k[:, :, :1], l, group=16), 'disagree'),
    (lambda q, k, l: group_column_sums(q, k[..., :8], l, group=16), 'disagree'),
    (lambda q, k, l: group_column_sums(q, k, l[:, :, :31], group=16), r'lse \(2, 2, 31\)'),
    (lambda q, k, l: group_column_sums(q, k, l[:1], group=16), 'must be \\[B, H, Lq\\]'),
    (lambda q, k, l: group_column_sums(q, k, l.astype(jnp.bfloat16), group=16),
     'lse must be float32'),
    (lambda q, k, l: group_column_sums(q.astype(jnp.int32), k, l, group=16), 'float32'),
    (lambda q, k, l: group_column_sums(q, k.astype(jnp.bfloat16), l, group=16), 'share'),
    (lambda q, k, l: group_column_sums(q, k, l, group=8), 'divisible by none'),
    (lambda q, k, l: group_column_sums(q, k, l, group=0), 'group=0'),
    (lambda q, k, l: group_column_sums(q, k, l, group=16, block_q=32), 'block_q=32'),
    (lambda q, k, l: group_column_sums(q, k, l, group=48, block_q=32), 'block_q=32'),
    (lambda q, k, l: group_column_sums(q, k, l, group=16, block_k=24), 'block_k=24'),
    (lambda q, k, l: group_column_sums(q, k, l, group=16, kv_len=41), 'kv_len=41'),
    (lambda q, k, l: group_column_sums(q, k, l, group=16, kv_len=0), 'kv_len=0'),
    (lambda q, k, l: group_column_sums(q, k, l, group=16, impl='mosaic'), 'no Mosaic GPU kernel'),
    (lambda q, k, l: group_column_sums(q, k, l, group=16, impl='cuda'), 'impl must be one of'),
])
def test_input_errors_are_named(call, match):
  with pytest.raises(ValueError, match=match):
    call(*_args())


def test_head_dim_must_be_a_power_of_two():
  with pytest.raises(ValueError, match='head dim'):
    group_column_sums(*_args(d=24), group=16)
