"""Matmul FLOPs counted on a jaxpr."""
import jax
import jax.numpy as jnp

from var_models.flop_count import flops

F32 = jnp.float32


def test_a_matmul_counts_two_m_n_k_and_element_wise_work_nothing():
  a, b = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 32), jnp.bfloat16)
  assert flops(lambda a, b: jnp.tanh(a @ b) + 1, a, b) == 2 * 64 * 128 * 32


def test_static_loops_count_every_trip_and_gradients_their_matmuls():
  x = jax.ShapeDtypeStruct((16, 16), F32)
  one = 2 * 16 ** 3
  assert flops(jax.jit(lambda x: jax.lax.fori_loop(0, 5, lambda i, y: y @ x, x)), x) == 5 * one
  assert flops(lambda xs: jax.lax.map(lambda r: r @ r, xs), jax.ShapeDtypeStruct((3, 16, 16), F32)) == 3 * one
  # forward, and the two matmuls of the backward pass (the rematerialised forward adds one)
  assert flops(jax.grad(lambda x: jnp.sum(x @ x)), x) == 3 * one
  assert flops(jax.grad(lambda x: jnp.sum(jax.checkpoint(lambda z: z @ z)(x))), x) == 3 * one


def test_a_convolution_counts_its_kernel_volume_per_output():
  img, w = jax.ShapeDtypeStruct((2, 8, 8, 3), F32), jax.ShapeDtypeStruct((3, 3, 3, 5), F32)
  conv = lambda i, w: jax.lax.conv_general_dilated(i, w, (1, 1), 'SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  assert flops(conv, img, w) == 2 * (2 * 8 * 8 * 5) * (3 * 3 * 3)


def test_a_cond_counts_its_costliest_branch():
  x = jax.ShapeDtypeStruct((16, 16), F32)
  f = lambda p, x: jax.lax.cond(p, lambda x: x @ x @ x, lambda x: x, x)
  assert flops(f, jax.ShapeDtypeStruct((), jnp.bool_), x) == 2 * 2 * 16 ** 3
