"""Every Mosaic GPU kernel lowers for CUDA on the CPU (shared memory, layouts, barriers, its
loads), in the Warpgroup semantics that `mosaic_gpu_api` pins: what a Hopper GPU runs on jax
0.10 and 0.11 alike. The GPU tests beside each kernel check their values."""
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dense_gelu_mgpu, layer_dense_mgpu, mosaic_gpu_api, sparse_attention_mgpu
from pallas_kernels.layout import layout_from_mask

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _lowered_text(fn, *args) -> str:
  return jax.jit(fn).trace(*args).lower(lowering_platforms=('cuda',)).as_text()


def test_compiler_params_pin_warpgroup_semantics():
  params = mosaic_gpu_api.compiler_params(approx_math=True)
  assert params.lowering_semantics == plgpu.LoweringSemantics.Warpgroup and params.approx_math


def test_dense_gelu_lowers_with_its_bias_load():
  fn = lambda x, w, b: dense_gelu_mgpu.dense_gelu(x, w, b, num_sms=8)
  assert 'mosaic_gpu' in _lowered_text(fn, S((256, 128), BF16), S((128, 512), BF16), S((512,), BF16))


@pytest.mark.parametrize('tiling, bias', [(layer_dense_mgpu.Tiling(64, 64, 1, 4), True),
                                          (layer_dense_mgpu.Tiling(64, 64, 1, 4), False),
                                          (layer_dense_mgpu.Tiling(128, 128, 2, 3), False)])
def test_layer_dense_lowers_with_and_without_bias(tiling, bias):
  args = [S((184, 256), BF16), S((3, 256, 512), BF16), S((3, 512), BF16) if bias else None]
  fn = lambda x, w, b, i: layer_dense_mgpu.layer_dense(x, w, b, i, tiling, num_sms=8)
  assert 'mosaic_gpu' in _lowered_text(fn, *args, S((), jnp.int32))


def _layout():
  mask = jnp.tril(jnp.ones((256, 256), bool))
  mask = mask.at[:, 200:].set(False)  # partial tiles: their bias loads
  return layout_from_mask(mask, 128, 64)


def test_sparse_attention_forward_lowers():
  layout = _layout()
  fn = lambda q, k, v: sparse_attention_mgpu.forward(q, k, v, layout, 0.125)
  assert 'mosaic_gpu' in _lowered_text(fn, *[S((1, 256, 2, 64), BF16)] * 3)


def test_sparse_attention_backward_lowers():
  layout = _layout()
  fn = lambda q, k, v, do, lse2, delta: sparse_attention_mgpu.backward(q, k, v, do, lse2, delta, layout, 0.125)
  rows = S((1, 2, 256), jnp.float32)
  assert 'mosaic_gpu' in _lowered_text(fn, *[S((1, 256, 2, 64), BF16)] * 4, rows, rows)
