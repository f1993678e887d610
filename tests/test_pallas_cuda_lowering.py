"""The GPU kernels lower for CUDA on the CPU: what interpret mode does not check.

The Triton kernels' lowering to Triton IR (the few-token attention, column sums and gated
residual have theirs beside their other tests), and every Mosaic GPU kernel's (shared memory,
layouts, barriers, its loads) in the Warpgroup semantics that `mosaic_gpu_api` pins: what a
Hopper GPU runs, on jax 0.10 and 0.11 alike. The GPU tests beside each kernel check values."""
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels as pk
from pallas_kernels import dense_gelu_mgpu, layer_dense_mgpu, mosaic_gpu_api, sparse_attention_mgpu
from pallas_kernels.layout import layout_from_mask

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _lowered_text(fn, *args) -> str:
  return jax.jit(fn).trace(*args).lower(lowering_platforms=('cuda',)).as_text()


TRITON = '__gpu$xla.gpu.triton'


def _mask_layout():
  mask = jnp.tril(jnp.ones((256, 256), bool))
  mask = mask.at[:, 200:].set(False)  # partial tiles beside full ones
  return layout_from_mask(mask, 128, 64)


def test_triton_sparse_attention_lowers_forward_and_backward():
  layout, q = _mask_layout(), S((1, 256, 2, 64), BF16)
  attention = lambda q, k, v: pk.block_sparse_attention(q, k, v, layout, impl='triton')
  grads = jax.grad(lambda *a: attention(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  assert _lowered_text(attention, q, q, q).count(TRITON) == 1
  assert _lowered_text(grads, q, q, q).count(TRITON) == 3   # the forward, dK/dV, dQ


def test_triton_gathered_attention_lowers():
  q, idx = S((1, 64, 2, 64), BF16), S((1, 2, 4, 32), jnp.int32)
  fn = lambda q, k, v, i: pk.gathered_attention(q, k, v, i, group=16, impl='triton')
  assert TRITON in _lowered_text(fn, q, q, q, idx)


def test_triton_top_k_and_token_gather_scatter_lower():
  rows, idx = S((2, 32, 128), BF16), S((2, 32), jnp.int32)
  assert TRITON in _lowered_text(lambda x: pk.top_k_indices(x, 16, impl='triton'), S((4, 1024), jnp.float32))
  assert TRITON in _lowered_text(lambda x, i: pk.gather_rows(x, i, impl='triton'), S((2, 256, 128), BF16), idx)
  scatter = lambda b, r, i: pk.token_scatter(b, r, i, impl='triton')
  assert TRITON in _lowered_text(scatter, S((2, 256, 128), BF16), rows, idx)


def test_triton_layer_dense_lowers():
  fn = lambda x, w, b: pk.layer_dense(x, w, b, 1, impl='triton')
  assert TRITON in _lowered_text(fn, S((16, 256), BF16), S((3, 256, 512), BF16), S((3, 512), BF16))


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


def test_sparse_attention_forward_lowers():
  layout = _mask_layout()
  fn = lambda q, k, v: sparse_attention_mgpu.forward(q, k, v, layout, 0.125)
  assert 'mosaic_gpu' in _lowered_text(fn, *[S((1, 256, 2, 64), BF16)] * 3)


def test_sparse_attention_backward_lowers():
  layout = _mask_layout()
  fn = lambda q, k, v, do, lse2, delta: sparse_attention_mgpu.backward(q, k, v, do, lse2, delta, layout, 0.125)
  rows = S((1, 2, 256), jnp.float32)
  assert 'mosaic_gpu' in _lowered_text(fn, *[S((1, 256, 2, 64), BF16)] * 4, rows, rows)
