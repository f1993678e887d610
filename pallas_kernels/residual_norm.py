"""A DiT block's gated residual and the next LayerNorm's modulated output in one Pallas kernel
(Triton lowering):

    x' = x + gate * (y + bias)
    h  = LN(x') * (1 + scale) + shift

where y is a sub-layer's output before its bias. In a sampler of E-CAR's flow denoisers (or
MAR's diffusion head) on a few rows, XLA runs this as three kernels of a few microseconds each
(the bias, gate and residual; the LayerNorm's statistics; the normalisation and modulation), each
costing about its launch (benchmarks/RESULTS.md, "where E-CAR-L's batch-1 block goes"); here one
program per row reads each input once and writes both outputs.

gate, shift and scale are [R, C] slices of a table of adaLN outputs, mod [R, K, C] (K slots of C
columns: a denoiser's merged adaLN GEMM, `blocks.concat_dense`), read in place by slot: the slices
are not copied out of it. Triton's tensors have power-of-two sizes, so a program reads its row's
C columns as a block of C rounded up, masked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_WIDTH = 8192   # a row's C columns, padded, held in one program's registers


def _kernel(x_ref, y_ref, bias_ref, gate_ref, shift_ref, scale_ref, x_out, h_out, *, c: int, eps: float):
  """One row: x, y, bias and the three modulation slices [C_p] (C real columns) -> x', h."""
  inside = jnp.arange(x_ref.shape[0]) < c
  load = lambda ref: plgpu.load(ref, mask=inside, other=0.0).astype(jnp.float32)
  x = load(x_ref) + load(gate_ref) * (load(y_ref) + load(bias_ref))
  mean = jnp.sum(x) / c
  var = jnp.maximum(jnp.sum(x * x) / c - mean * mean, 0.0)
  h = (x - mean) * jax.lax.rsqrt(var + eps) * (1.0 + load(scale_ref)) + load(shift_ref)
  plgpu.store(x_out, x, mask=inside)
  plgpu.store(h_out, h.astype(h_out.dtype), mask=inside)


def _forward(x, y, bias, mod, slots, eps: float, interpret: bool):
  r, c = x.shape
  c_p = pl.next_power_of_2(c)
  row = pl.BlockSpec((None, c_p), lambda i: (i, 0))
  slot = lambda j: pl.BlockSpec((None, None, c_p), lambda i: (i, j, 0))
  return pl.pallas_call(
      functools.partial(_kernel, c=c, eps=eps),
      grid=(r,),
      in_specs=[row, row, pl.BlockSpec((c_p,), lambda i: (0,))] + [slot(j) for j in slots],
      out_specs=[row, row],
      out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(x.shape, y.dtype)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name='residual_norm',
  )(x, y, bias, mod, mod, mod)


def reference(x, y, bias, mod, slots, eps: float):
  """The same, as a flax DiT block computes it: the bias, gate and modulation in y's dtype, the
  residual and the LayerNorm's statistics (E[x^2] - E[x]^2) in float32."""
  gate, shift, scale = (mod[:, j] for j in slots)
  x = x + gate * (y + bias)
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.maximum(jnp.mean(jnp.square(x), -1, keepdims=True) - jnp.square(mean), 0.0)
  normed = ((x - mean) * jax.lax.rsqrt(var + eps)).astype(y.dtype)
  return x, normed * (1 + scale) + shift


def unsupported(x, y, bias, mod, slots) -> str:
  """Why residual_norm does not take these inputs ('' when it does)."""
  if x.ndim != 2 or y.shape != x.shape or bias.shape != x.shape[1:] or mod.shape[::2] != x.shape:
    return (f'x and y [R, C], bias [C], mod [R, K, C] expected, got {x.shape}, {y.shape}, {bias.shape}, '
            f'{mod.shape}')
  if len(slots) != 3 or not all(0 <= j < mod.shape[1] for j in slots):
    return f'slots (gate, shift, scale) must be 3 indices into mod\'s {mod.shape[1]} slots, got {slots}'
  if x.dtype != jnp.float32:
    return f'x (the residual stream) must be float32, got {x.dtype}'
  if y.dtype not in DTYPES or bias.dtype != y.dtype or mod.dtype != y.dtype:
    return f'y, bias and mod of one dtype among {[jnp.dtype(t).name for t in DTYPES]}, got {y.dtype}, ' \
           f'{bias.dtype}, {mod.dtype}'
  if pl.next_power_of_2(x.shape[1]) > MAX_WIDTH:
    return f'at most {MAX_WIDTH} columns, got {x.shape[1]}'
  return ''


def residual_norm(x, y, bias, mod, slots: tuple[int, int, int], *, eps: float, impl: str = 'auto'):
  """x [R, C] float32 (a residual stream), y [R, C] (a sub-layer's output before its bias [C]),
  mod [R, K, C] (adaLN outputs), slots: mod's (gate, shift, scale) -> (x + gate * (y + bias)
  [R, C] float32, its LayerNorm (no affine, `eps`) times (1 + scale) plus shift [R, C] in y's
  dtype). `impl`: see `pallas_kernels.dispatch` ('auto': the Triton lowering on an NVIDIA GPU,
  the reference elsewhere). Not differentiable: samplers only."""
  slots = tuple(int(j) for j in slots)
  why = unsupported(x, y, bias, mod, slots)
  if why:
    raise ValueError(f'residual_norm: {why}')
  impl = dispatch.resolve(impl)
  if impl == 'mosaic':
    raise ValueError(f"impl='mosaic': {dispatch.NO_MOSAIC}")
  if impl == 'reference':
    return reference(x, y, bias, mod, slots, eps)
  return _forward(x, y, bias, mod, slots, float(eps), impl == 'interpret')
