"""pallas_kernels.adaln_mlp: the adaLN MLP block's two kernels against the plain-jnp reference (flax's
computation) on random inputs, in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import adaln_mlp
from pallas_kernels.adaln_mlp import AUTO_MAX_ROWS, reference


def _inputs(m, c=128, f=256, dtype=jnp.float32, seed=0):
  """x, shift, scale, gate [m, c], ln (scale, bias) [c], mlp (w1 [c, f], b1, w2 [f, c], b2)."""
  k = iter(jax.random.split(jax.random.key(seed), 10))
  normal = lambda shape, s=1.0, mean=0.0: (mean + s * jax.random.normal(next(k), shape)).astype(dtype)
  x = normal((m, c), 2.0, 0.5)   # a mean off zero: the statistics must not cancel
  shift, scale, gate = normal((m, c), 0.5), normal((m, c), 0.5), normal((m, c), 0.5)
  ln = (normal((c,), 0.1, 1.0), normal((c,), 0.1))
  mlp = (normal((c, f), 1 / np.sqrt(c)), normal((f,), 0.1), normal((f, c), 1 / np.sqrt(f)), normal((c,), 0.1))
  return x, shift, scale, gate, ln, mlp


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize('m,gated,affine', [(5, True, True), (37, False, True), (1, True, False)])
def test_kernels_compute_the_reference_block(m, gated, affine):
  x, shift, scale, gate, ln, mlp = _inputs(m)
  gate, ln = gate if gated else None, ln if affine else None
  got = adaln_mlp(x, shift, scale, gate, ln, mlp, impl='interpret')
  assert got.shape == (m, 128) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, reference(x, shift, scale, gate, ln, mlp), rtol=2e-5, atol=2e-5)


def test_bf16_kernels_round_where_the_layers_do():
  """In bf16 the kernels round each layer's output as flax does; what is left is the products'
  order of summation: within bf16's rounding of the float32 computation."""
  x, shift, scale, gate, ln, mlp = _inputs(12, dtype=jnp.bfloat16)
  got = adaln_mlp(x, shift, scale, gate, ln, mlp, impl='interpret')
  want = reference(x, shift, scale, gate, ln, mlp)
  f32 = reference(*(jax.tree.map(lambda a: a.astype(jnp.float32), (x, shift, scale, gate, ln, mlp))))
  assert got.dtype == jnp.bfloat16
  assert _rel(got.astype(jnp.float32), want.astype(jnp.float32)) < 5e-3
  assert _rel(got.astype(jnp.float32), f32) < 1.5 * _rel(want.astype(jnp.float32), f32) + 1e-3


@pytest.mark.parametrize('tiling', [dict(block_n=32, block_k=64), dict(block_n=128, block_k=128, num_warps=8)])
def test_every_tiling_computes_the_same_block(tiling):
  x, shift, scale, gate, ln, mlp = _inputs(3)
  got = adaln_mlp(x, shift, scale, gate, ln, mlp, impl='interpret', **tiling)
  np.testing.assert_allclose(got, reference(x, shift, scale, gate, ln, mlp), rtol=2e-5, atol=2e-5)


def test_leading_axes_and_a_traced_loop():
  x, shift, scale, gate, ln, mlp = _inputs(6)
  lead = lambda a: a.reshape(2, 3, -1)
  step = lambda h, _: (adaln_mlp(h, lead(shift), lead(scale), lead(gate), ln, mlp, impl='interpret'), None)
  got = jax.lax.scan(step, lead(x), None, length=2)[0]
  want = reference(reference(x, shift, scale, gate, ln, mlp), shift, scale, gate, ln, mlp)
  np.testing.assert_allclose(got.reshape(6, -1), want, rtol=1e-4, atol=1e-4)


def test_gradients_go_through_the_reference():
  x, shift, scale, gate, ln, mlp = _inputs(4)
  loss = lambda impl: lambda x, w1: jnp.sum(jnp.sin(adaln_mlp(x, shift, scale, gate, ln, (w1, *mlp[1:]), impl=impl)))
  got = jax.grad(loss('interpret'), argnums=(0, 1))(x, mlp[0])
  want = jax.grad(loss('reference'), argnums=(0, 1))(x, mlp[0])
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_auto_leaves_many_rows_and_cpus_to_the_reference():
  x, shift, scale, gate, ln, mlp = _inputs(AUTO_MAX_ROWS + 1)
  np.testing.assert_array_equal(adaln_mlp(x, shift, scale, gate, ln, mlp), reference(x, shift, scale, gate, ln, mlp))


def test_bad_shapes_and_tilings_name_the_problem():
  x, shift, scale, gate, ln, mlp = _inputs(4)
  with pytest.raises(ValueError, match=r'gate must be \(4, 128\)'):
    adaln_mlp(x, shift, scale, gate[:, :64], ln, mlp)
  with pytest.raises(ValueError, match=r'w2 must be \(256, 128\)'):
    adaln_mlp(x, shift, scale, gate, ln, (mlp[0], mlp[1], mlp[2][:, :64], mlp[3]))
  with pytest.raises(ValueError, match='multiples of block_k 256'):
    adaln_mlp(x, shift, scale, gate, ln, mlp, impl='interpret', block_k=256)
  with pytest.raises(ValueError, match='no Mosaic GPU kernel'):
    adaln_mlp(x, shift, scale, gate, ln, mlp, impl='mosaic')
