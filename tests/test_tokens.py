"""Token scatters by index and a residual stream's kept rows: the in-place forms equal the plain
ones they replace."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from var_models.nn import tokens as tok
from var_models.nn.blocks import BlockHooks
from var_models.nn.vit import Block


def _data(dtype_base, dtype_y):
  kb, ky = jax.random.split(jax.random.key(0))
  base = jax.random.normal(kb, (2, 7, 5)).astype(dtype_base)
  y = jax.random.normal(ky, (2, 3, 5)).astype(dtype_y)
  idx = jnp.array([[6, 0, 7], [2, 7, 4]], jnp.int32)   # 7 is out of range: dropped
  return base, idx, y


def test_dense_writes_the_rows_at_their_positions_and_drops_out_of_range_ones():
  base, idx, y = _data(jnp.float32, jnp.float32)
  np.testing.assert_array_equal(tok.dense(tok.Rows(base, idx, y)), tok.scatter(base, idx, y))
  assert tok.dense(base) is base


class _Forward(BlockHooks):
  """Forwards the tokens idx at both sub-layers, the others' branch output 0."""
  def __init__(self, idx):
    self.idx = idx

  def select(self, site, x, state):
    return self.idx, state


class _ForwardRestoring(_Forward):
  """The same, its restore the default's written out: x + the outputs scattered into zeros."""
  def restore(self, site, y, idx, x, state):
    return tok.scatter(jnp.zeros_like(x, dtype=y.dtype), idx, y), state


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_blocks_forwarding_the_same_tokens_keep_them_as_rows_equal_to_adding_a_scatter_into_zeros(dtype):
  block = Block(width=16, num_heads=2, dtype=dtype)
  x = jax.random.normal(jax.random.key(0), (2, 9, 16), dtype)
  idx = jnp.array([[8, 0, 3], [2, 5, 4]], jnp.int32)
  params = [block.init(jax.random.key(i), x)['params'] for i in (1, 2)]

  def run(hooks):
    h = x
    for p in params:
      h, _, _ = block.apply({'params': p}, h, hooks=hooks)
    return h

  kept, plain = run(_Forward(idx)), run(_ForwardRestoring(idx))
  assert isinstance(kept, tok.Rows) and kept.idx is idx and not isinstance(plain, tok.Rows)
  got, want = np.asarray(tok.dense(kept), np.float32), np.asarray(plain, np.float32)
  if dtype == jnp.float32:
    np.testing.assert_array_equal(got, want)
  else:   # bfloat16: XLA may fuse the plain form's residual add into the next LayerNorm
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
  untouched = np.ones(x.shape[:2], bool)
  untouched[np.arange(2)[:, None], np.asarray(idx)] = False
  np.testing.assert_array_equal(got[untouched], np.asarray(x, np.float32)[untouched])


def test_scatter_layer_writes_one_layer_of_the_stack_as_a_scatter_of_that_layer_would():
  base, idx, y = _data(jnp.float32, jnp.float32)
  stack = jnp.stack([base, -base, 2 * base])
  for layer in (1, jnp.int32(2)):
    expect = stack.at[layer].set(tok.scatter(stack[layer], idx, y))
    np.testing.assert_array_equal(tok.scatter_layer(stack, layer, idx, y), expect)
  traced = jax.jit(tok.scatter_layer)(stack, jnp.int32(0), idx, y)
  np.testing.assert_array_equal(traced, stack.at[0].set(tok.scatter(stack[0], idx, y)))
