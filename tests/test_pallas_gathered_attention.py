"""Gathered-key attention (Pallas, interpret mode) against its float64 reference.

Interpret mode fills outputs with NaN before the kernel runs
(tests/test_pallas_attention.py checks it), so an element the kernel fails to
write fails the comparison.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gathered_attention, masked_attention, reference

B, H, D = 2, 2, 16


def _qkv(seed, lq, lk, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal((B, n, H, D)), dtype) for n in (lq, lk, lk))


def _idx(seed, lq, group, n, kv_len, lk):
  """Distinct keys in [0, kv_len) per (b, h, group), about a quarter of the entries
  replaced by padding: -1, or rows in [kv_len, lk) (spare KV-cache rows) when any."""
  rng = np.random.default_rng(seed)
  g = -(-lq // group)
  idx = np.stack([rng.permutation(kv_len)[:n] for _ in range(B * H * g)]).reshape(B, H, g, n)
  pad = rng.random(idx.shape) < 0.25
  spare = rng.integers(kv_len, lk, idx.shape) if lk > kv_len else np.full(idx.shape, lk + 3)
  idx[pad] = np.where(rng.random(idx.shape) < 0.5, -1, spare)[pad]
  return jnp.asarray(idx, jnp.int32)


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.isfinite(got).all(), 'kernel left unwritten (NaN) or non-finite elements'
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _ref(q, k, v, idx, group, kv_len):
  """float64 (out, lse) of the reference on the same (possibly bf16-rounded) inputs."""
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v)]
    out, lse = reference.gathered_attention(*args, idx, group, 1 / np.sqrt(D), kv_len)
    return np.asarray(out), np.asarray(lse)


def _check(q, k, v, idx, group, kv_len, tol, **kw):
  out, lse = gathered_attention(q, k, v, idx, group=group, kv_len=kv_len, impl='interpret',
                                return_lse=True, **kw)
  ref_out, ref_lse = _ref(q, k, v, idx, group, kv_len)
  assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == ref_lse.shape
  assert _rel(out, ref_out) < tol
  np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(ref_lse))
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=tol, atol=tol)
  return out, lse


@pytest.mark.parametrize('dtype, tol', [(jnp.float32, 2e-5), (jnp.bfloat16, 1e-2)])
def test_matches_reference_with_padding_and_tails(dtype, tol):
  # Lq 40: not a multiple of block_q 16; n 37: not a multiple of block_k 16; group 32:
  # two query blocks per group, the last group partial.
  lq, lk, group = 40, 50, 32
  q, k, v = _qkv(0, lq, lk, dtype)
  idx = _idx(1, lq, group, 37, lk, lk)
  _check(q, k, v, idx, group, lk, tol, block_q=16, block_k=16)


@pytest.mark.parametrize('fill', [1e30, np.nan], ids=['huge', 'nan'])
def test_spare_kv_rows_past_kv_len_never_leak(fill):
  lq, lk, kv_len, group = 24, 60, 41, 16
  q, k, v = _qkv(2, lq, lk)
  k, v = (x.at[:, kv_len:].set(fill) for x in (k, v))
  idx = _idx(3, lq, group, 20, kv_len, lk)
  assert (np.asarray(idx) >= kv_len).any()   # some entries point at the spare rows
  _check(q, k, v, idx, group, kv_len, 2e-5, block_k=16)


def test_group_with_only_padding_gives_zeros_and_minus_inf_lse():
  lq, lk, group = 32, 40, 16
  q, k, v = _qkv(4, lq, lk)
  idx = np.asarray(_idx(5, lq, group, 24, lk, lk)).copy()
  idx[0, 1, 1] = -1          # batch 0, head 1, second group: no valid key
  idx[1, 0, 0, ::2] = lk     # half of one row padding past the keys
  out, lse = _check(q, k, v, jnp.asarray(idx), group, lk, 2e-5, block_k=16)
  assert (np.asarray(out)[0, group:, 1] == 0).all()
  assert np.isneginf(np.asarray(lse)[0, 1, group:]).all()
  assert np.isfinite(np.asarray(lse)[0, 0]).all()


def test_all_keys_listed_equals_dense_attention():
  # Every key once, in a scrambled order per group: the dense softmax, and the
  # reference agrees with masked_attention's (a cross-check of the reference).
  lq, lk, group = 20, 36, 16
  q, k, v = _qkv(6, lq, lk)
  rng = np.random.default_rng(7)
  idx = jnp.asarray(np.stack([rng.permutation(lk) for _ in range(B * H * 2)]).reshape(B, H, 2, lk))
  want_out, want_lse = masked_attention(q, k, v, np.ones((1, lq, lk), bool), 1 / np.sqrt(D))
  for impl in ('reference', 'interpret'):
    out, lse = gathered_attention(q, k, v, idx, group=group, impl=impl, return_lse=True,
                                  block_k=16)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-5, atol=2e-5)


def test_a_repeated_key_counts_twice():
  # Listing key j twice equals a softmax where key j's weight is doubled (its logit + log 2).
  lq, lk, group = 16, 20, 16
  q, k, v = _qkv(8, lq, lk)
  idx = jnp.broadcast_to(jnp.asarray([0, 3, 3, 7], jnp.int32), (B, H, 1, 4))
  out = gathered_attention(q, k, v, idx, group=group, impl='interpret')
  s = jnp.einsum('bqhd,bkhd->bhqk', q, k[:, jnp.asarray([0, 3, 7])]) / np.sqrt(D)
  p = jax.nn.softmax(s + jnp.log(jnp.asarray([1.0, 2.0, 1.0])), axis=-1)
  want = jnp.einsum('bhqk,bkhd->bqhd', p, v[:, jnp.asarray([0, 3, 7])])
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)


def _args(lq=32, lk=40, n=8, group=16, d=D, dtype=jnp.float32, idx_dtype=jnp.int32):
  q = jnp.ones((B, lq, H, d), dtype)
  k = jnp.ones((B, lk, H, d), dtype)
  return q, k, k, jnp.zeros((B, H, -(-lq // group), n), idx_dtype)


@pytest.mark.parametrize('call, match', [
    (lambda q, k, v, i: gathered_attention(q[0], k, v, i, group=16), 'expected q'),
    (lambda q, k, v, i: gathered_attention(q, k[:, :, :1], v[:, :, :1], i, group=16),
     'disagree'),
    (lambda q, k, v, i: gathered_attention(q, k, v[:, :30], i, group=16), 'expected q'),
    (lambda q, k, v, i: gathered_attention(q, k, v, i[:, :, :1], group=16), 'ceil'),
    (lambda q, k, v, i: gathered_attention(q, k, v, i[:1], group=16), 'ceil'),
    (lambda q, k, v, i: gathered_attention(q, k, v, i, group=8), 'divisible by none'),
    (lambda q, k, v, i: gathered_attention(q, k, v, i, group=16, block_q=32), 'block_q=32'),
    (lambda q, k, v, i: gathered_attention(q, k, v, i, group=16, block_k=24), 'block_k=24'),
    (lambda q, k, v, i: gathered_attention(q, k, v, i.astype(jnp.float32), group=16),
     'idx must be integers'),
    (lambda q, k, v, i: gathered_attention(q, k, v, i, group=16, kv_len=41), 'kv_len=41'),
    (lambda q, k, v, i: gathered_attention(q, k, v, i, group=16, kv_len=0), 'kv_len=0'),
    (lambda q, k, v, i: gathered_attention(q.astype(jnp.int32), k, v, i, group=16), 'float32'),
    (lambda q, k, v, i: gathered_attention(q, k.astype(jnp.bfloat16), v, i, group=16), 'share'),
    (lambda q, k, v, i: gathered_attention(q, k, v, i[..., :0], group=16), 'n = 0'),
    (lambda q, k, v, i: gathered_attention(q, k, v, i, group=16, impl='mosaic'), 'TMA'),
])
def test_input_errors_are_named(call, match):
  with pytest.raises(ValueError, match=match):
    call(*_args())


def test_head_dim_must_be_a_power_of_two():
  with pytest.raises(ValueError, match='head dim'):
    gathered_attention(*_args(d=24), group=16)
