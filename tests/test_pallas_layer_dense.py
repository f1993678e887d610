"""pallas_kernels.layer_dense: one layer of stacked weights applied in place, against the plain
XLA form (the layer's slice copied) on random inputs, in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import layer_dense, layer_dense_mgpu
from pallas_kernels.dispatch import is_hopper
from pallas_kernels.layer_dense import AUTO_MAX_ROWS, reference


def _inputs(m, k, n, layers=3, dtype=jnp.float32, bias=True):
  keys = jax.random.split(jax.random.key(m * 7 + n), 3)
  x = jax.random.normal(keys[0], (m, k), dtype)
  w = (jax.random.normal(keys[1], (layers, k, n)) / np.sqrt(k)).astype(dtype)
  b = jax.random.normal(keys[2], (layers, n)).astype(dtype) if bias else None
  return x, w, b


@pytest.mark.parametrize('m,k,n,bias', [(2, 128, 96, True), (37, 64, 256, False), (130, 192, 48, True)])
def test_kernel_reads_the_named_layer_of_the_stack(m, k, n, bias):
  x, w, b = _inputs(m, k, n, bias=bias)
  for layer in (0, 2):
    got = layer_dense(x, w, b, jnp.int32(layer), impl='interpret')
    want = x @ w[layer] + (0 if b is None else b[layer])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_kernel_takes_a_traced_layer_inside_a_scan_and_leading_axes():
  x = jax.random.normal(jax.random.key(8), (2, 2, 64))
  w = jax.random.normal(jax.random.key(9), (4, 64, 64)) / 8
  b = jax.random.normal(jax.random.key(10), (4, 64))
  scanned, _ = jax.lax.scan(lambda h, i: (jnp.tanh(layer_dense(h, w, b, i, impl='interpret')), None),
                            x, jnp.arange(4))
  unrolled = x
  for i in range(4):
    unrolled = jnp.tanh(unrolled @ w[i] + b[i])
  np.testing.assert_allclose(scanned, unrolled, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('tiling', [dict(block_n=32, block_k=32, splits=1), dict(block_n=16, block_k=64, splits=3),
                                    dict(block_n=64, block_k=16, splits=6, num_warps=8, num_stages=4),
                                    dict(block_m=32, block_n=64, block_k=64, splits=1)])
def test_every_tiling_computes_the_same_layer(tiling):
  x, w, b = _inputs(37, 192, 64)
  got = layer_dense(x, w, b, 2, impl='interpret', **tiling)
  np.testing.assert_allclose(got, x @ w[2] + b[2], rtol=2e-5, atol=2e-5)


def test_a_tiling_that_does_not_divide_the_shape_names_it():
  x, w, b = _inputs(4, 128, 64)
  with pytest.raises(ValueError, match='splits 3 the 2 K blocks'):
    layer_dense(x, w, b, 0, impl='interpret', splits=3)
  with pytest.raises(ValueError, match='block_n 48 must divide N=64'):
    layer_dense(x, w, b, 0, impl='interpret', block_n=48)
  with pytest.raises(ValueError, match='block_m 24 is not a multiple of 16'):
    layer_dense(x, w, b, 0, impl='interpret', block_m=24)


def test_bf16_kernel_rounds_before_the_bias_as_flax_dense_does():
  x, w, b = _inputs(8, 128, 64, dtype=jnp.bfloat16)
  got = layer_dense(x, w, b, 1, impl='interpret')
  want = reference(x, w, b, 1)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_auto_leaves_many_rows_and_cpus_to_the_reference():
  x, w, b = _inputs(AUTO_MAX_ROWS + 1, 64, 32)
  np.testing.assert_array_equal(layer_dense(x, w, b, 1), reference(x, w, b, 1))


def test_reference_keeps_the_gemm_apart_from_its_bias():
  """An optimization barrier between the GEMM and the bias add: XLA cannot fold the bias into the
  GEMM's epilogue, which would keep cuBLAS from reading w[layer] in place."""
  x, w, b = _inputs(4, 64, 32)
  names = [e.primitive.name for e in jax.make_jaxpr(reference)(x, w, b, 1).eqns]
  assert names.index('dot_general') < names.index('optimization_barrier') < names.index('add')


def test_bad_shapes_name_the_problem():
  x, w, b = _inputs(4, 64, 32)
  with pytest.raises(ValueError, match='w \\[L, K, N\\]'):
    layer_dense(x, w[0], b, 0)
  with pytest.raises(ValueError, match='K=48 is not a multiple'):
    layer_dense(x[:, :48], w[:, :48], b, 0, impl='interpret')


# ---------------------------------------------------------------- the Mosaic GPU kernel (Hopper)
MAR_H_SHAPES = [(1280, 3840), (1280, 1280), (1280, 5120), (5120, 1280)]


@pytest.mark.parametrize('m', [40, 184, 640])
@pytest.mark.parametrize('k,n', MAR_H_SHAPES + [(2048, 6144), (8192, 2048)])
def test_mosaic_tiling_divides_the_shape_and_fits_shared_memory(m, k, n):
  assert layer_dense_mgpu.tiling_error(k, n, layer_dense_mgpu.choose(m, k, n, 132)) == ''


def test_mosaic_tiling_errors_name_the_misfit():
  assert 'must divide N=384' in layer_dense_mgpu.tiling_error(1280, 384, layer_dense_mgpu.Tiling(64, 128, 1, 4))
  assert 'splits 3' in layer_dense_mgpu.tiling_error(1280, 1280, layer_dense_mgpu.Tiling(64, 64, 3, 4))
  assert 'shared memory' in layer_dense_mgpu.tiling_error(1280, 1280, layer_dense_mgpu.Tiling(128, 128, 1, 5))


def test_mosaic_impl_names_what_it_does_not_take():
  x, w, b = _inputs(8, 64, 128)
  with pytest.raises(ValueError, match="impl='mosaic'.*bfloat16 or float16"):
    layer_dense(x, w, b, 0, impl='mosaic')
  x, w, b = _inputs(306, 64, 128, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="impl='mosaic'.*M a multiple of 8.*got 306"):
    layer_dense(x, w, b, 0, impl='mosaic')


@pytest.mark.skipif(not is_hopper(), reason='the Mosaic GPU kernel runs on Hopper GPUs only')
@pytest.mark.parametrize('m', [40, 184, 640])
@pytest.mark.parametrize('k,n', MAR_H_SHAPES)
@pytest.mark.parametrize('tiling', [None] + [layer_dense_mgpu.Tiling(*t) for t in
                                             ((64, 64, 4, 4), (128, 128, 1, 3), (128, 64, 1, 4))])
def test_mosaic_kernel_matches_the_reference_in_a_scan(m, k, n, tiling):
  x, w, b = _inputs(m, k, n, layers=4, dtype=jnp.bfloat16, bias=n != 1280 or k != 1280)

  def layers(dense):
    return jax.jit(lambda x, w, b: jax.lax.scan(lambda h, i: (h, dense(x, w, b, i)), 0, jnp.arange(4))[1])

  got = layers(lambda *a: layer_dense(*a, impl='mosaic', mosaic_tiling=tiling))(x, w, b)
  want = layers(reference)(x, w, b)
  got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
  rel = np.linalg.norm(got32 - want32) / np.linalg.norm(want32)
  assert got.dtype == jnp.bfloat16 and rel < 1e-2, rel
