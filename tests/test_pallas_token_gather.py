"""Top-k token gather/scatter kernels (Pallas, interpret mode) against their references.

Interpret mode fills fresh outputs with NaN (tests/test_pallas_attention.py
checks it), so an unwritten gathered element fails; the scatter's output is its
base, so an unwritten or misplaced row shows as a base value where a new one belongs.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gather_rows, token_scatter, topk_gather


def _x(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize('n, c, k, dtype', [
    (50, 40, 37, jnp.float32),     # k and C not multiples of the tile
    (70, 600, 33, jnp.bfloat16),   # C over one column tile
])
def test_topk_gather_returns_the_top_scoring_rows(n, c, k, dtype):
  x, scores = _x(0, (2, n, c), dtype), _x(1, (2, n))
  rows, idx = topk_gather(x, scores, k, impl='interpret')
  assert rows.shape == (2, k, c) and rows.dtype == dtype and idx.shape == (2, k)
  want_idx = np.argsort(-np.asarray(scores), axis=1, kind='stable')[:, :k]
  np.testing.assert_array_equal(np.asarray(idx), want_idx)
  want = np.take_along_axis(np.asarray(x), want_idx[..., None], axis=1)
  np.testing.assert_array_equal(np.asarray(rows), want)


def test_token_scatter_writes_rows_and_keeps_the_rest():
  base, new = _x(2, (2, 50, 40)), _x(3, (2, 37, 40))
  idx = jnp.asarray(np.stack([np.random.default_rng(s).permutation(50)[:37] for s in (4, 5)]))
  out = token_scatter(base, new, idx, impl='interpret')
  want = np.asarray(base).copy()
  for b in range(2):
    want[b, np.asarray(idx[b])] = np.asarray(new[b])
  np.testing.assert_array_equal(np.asarray(out), want)


def test_gather_then_scatter_into_base_is_identity_under_jit():
  x, scores = _x(6, (3, 64, 32)), _x(7, (3, 64))

  @jax.jit
  def round_trip(x, scores):
    rows, idx = topk_gather(x, scores, 20, impl='interpret')
    return token_scatter(jnp.zeros_like(x), rows, idx, impl='interpret'), idx

  out, idx = round_trip(x, scores)
  kept = np.zeros((3, 64), bool)
  np.put_along_axis(kept, np.asarray(idx), True, axis=1)
  np.testing.assert_array_equal(np.asarray(out)[kept], np.asarray(x)[kept])
  assert (np.asarray(out)[~kept] == 0).all()


def test_reference_impl_equals_interpret():
  x, scores = _x(9, (2, 40, 24)), _x(10, (2, 40))
  a, idx = topk_gather(x, scores, 9, impl='interpret')
  b, _ = topk_gather(x, scores, 9, impl='reference')
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(gather_rows(x, idx, impl='reference')), np.asarray(b))


@pytest.mark.parametrize('call, match', [
    (lambda x: topk_gather(x, x[..., 0], 0), 'k must be'),
    (lambda x: topk_gather(x, x[:, :3, 0], 2), 'scores'),
    (lambda x: token_scatter(x, x[:, :2], jnp.zeros((2, 3), jnp.int32)), 'rows'),
    (lambda x: gather_rows(x, jnp.zeros((2, 3))), 'integers'),
])
def test_bad_arguments_raise_clear_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call(_x(11, (2, 8, 4)))


def test_token_kernels_have_no_mosaic_impl():
  x = jnp.ones((1, 8, 4), jnp.float32)
  with pytest.raises(ValueError, match='no Mosaic GPU kernel'):
    gather_rows(x, jnp.zeros((1, 2), jnp.int32), impl='mosaic')
