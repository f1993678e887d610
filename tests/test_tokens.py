"""Token scatters by index: the in-place forms equal the plain ones they replace."""
import jax
import jax.numpy as jnp
import numpy as np

from var_models.nn import tokens as tok


def _data(dtype_base, dtype_y):
  kb, ky = jax.random.split(jax.random.key(0))
  base = jax.random.normal(kb, (2, 7, 5)).astype(dtype_base)
  y = jax.random.normal(ky, (2, 3, 5)).astype(dtype_y)
  idx = jnp.array([[6, 0, 7], [2, 7, 4]], jnp.int32)   # 7 is out of range: dropped
  return base, idx, y


def test_scatter_add_equals_adding_a_scatter_into_zeros_and_drops_out_of_range_positions():
  for dtypes in ((jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32)):
    base, idx, y = _data(*dtypes)
    expect = base + tok.scatter(jnp.zeros_like(base, dtype=y.dtype), idx, y)
    got = tok.scatter_add(base, idx, y)
    assert got.dtype == expect.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expect, np.float32))


def test_scatter_layer_writes_one_layer_of_the_stack_as_a_scatter_of_that_layer_would():
  base, idx, y = _data(jnp.float32, jnp.float32)
  stack = jnp.stack([base, -base, 2 * base])
  for layer in (1, jnp.int32(2)):
    expect = stack.at[layer].set(tok.scatter(stack[layer], idx, y))
    np.testing.assert_array_equal(tok.scatter_layer(stack, layer, idx, y), expect)
  traced = jax.jit(tok.scatter_layer)(stack, jnp.int32(0), idx, y)
  np.testing.assert_array_equal(traced, stack.at[0].set(tok.scatter(stack[0], idx, y)))
