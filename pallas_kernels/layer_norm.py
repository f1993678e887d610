"""One layer's affine LayerNorm out of parameters stacked on a layer axis, read in place.

`layer_norm(x, scale, shift, layer, eps=eps)` is flax's `nn.LayerNorm(epsilon=eps,
use_fast_variance=False)` of x [..., C] with the parameters scale[layer] and shift[layer] (scale,
shift [L, C]; `layer` an int32 scalar, traced inside a scan over the layers): two-pass statistics
in float32, (x - mean) * (rsqrt(var + eps) * scale) + shift, rounded to the output dtype. On the
GPU XLA's Triton LayerNorm fusions cannot take a dynamic slice of the stack as an operand, so XLA
copies each LayerNorm's scale and bias out of the stack, one device copy each per layer (4 per ViT
block and layer iteration, thousands per MAR sampling call). The Pallas kernel (Triton lowering)
reads scale[layer] and shift[layer] straight from the stacks: one program per block of a few rows
of x [M, C] reads its rows once, as C / chunk power-of-two chunks held in registers (Triton's blocks
are powers of two; MAR-H's C = 1280 is five of 256), takes the row sums, then the squared
deviations from the mean, in float32, and writes the normalised, scaled and shifted rows; the last
row block's overhang is masked. The rows per program shrink as C grows (ROW_ELEMENTS a program),
so that small M still spreads over many SMs and the chunks fit in registers.

'auto' runs the kernel on an NVIDIA GPU, the plain-jnp reference elsewhere and for the shapes
`unsupported` names.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch
from pallas_kernels.layer_dense import _block
from pallas_kernels.sparse_attention import DTYPES, _row_mask

ROW_ELEMENTS = 4096   # elements of x a program holds: rows per program = the power of two <= this / C
MAX_C = 4 * ROW_ELEMENTS
CHUNK_CHOICES = (1024, 512, 256, 128, 64, 32, 16)   # the chunks C is held in: the largest dividing C


def _out_dtype(x, scale, shift, dtype):
  """flax's: `dtype`, else the promotion of x and the parameters."""
  return jnp.result_type(x, scale, shift) if dtype is None else dtype


def reference(x, scale, shift, layer, eps: float, dtype=None):
  """flax's `nn.LayerNorm(epsilon=eps, use_fast_variance=False, dtype=dtype)` of x [..., C] with
  scale[layer], shift[layer] (scale, shift [L, C]), its formula and casts as flax's `_compute_stats`
  and `_normalize` have them."""
  at = lambda a: lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)
  xs = x.astype(jnp.promote_types(x.dtype if dtype is None else dtype, jnp.float32))
  mean = xs.mean(-1, keepdims=True)
  var = lax.square(xs - mean).mean(-1, keepdims=True)
  y = (x - mean) * (lax.rsqrt(var + eps) * at(scale)) + at(shift)
  return y.astype(_out_dtype(x, scale, shift, dtype))


def _kernel(layer_ref, x_ref, scale_ref, shift_ref, o_ref, *, rows: int, chunk: int, eps: float):
  """One block of rows [block_m, C], read once: its statistics over C, then its output. Rows past
  `rows` (the last block's overhang) are neither read nor written."""
  layer, (block_m, c) = layer_ref[0], x_ref.shape
  mask = _row_mask(pl.program_id(0) * block_m, block_m, rows, 2)   # [block_m, 1]
  cols = [pl.ds(t * chunk, chunk) for t in range(c // chunk)]
  xs = [plgpu.load(x_ref.at[:, at], mask=mask, other=0).astype(jnp.float32) for at in cols]
  mean = sum(x.sum(1, keepdims=True) for x in xs) / c
  xs = [x - mean for x in xs]
  inv = lax.rsqrt(sum(jnp.square(x).sum(1, keepdims=True) for x in xs) / c + eps)
  for at, x in zip(cols, xs):
    mul = inv * plgpu.load(scale_ref.at[layer, at]).astype(jnp.float32)[None, :]
    y = x * mul + plgpu.load(shift_ref.at[layer, at]).astype(jnp.float32)[None, :]
    plgpu.store(o_ref.at[:, at], y.astype(o_ref.dtype), mask=mask)


def _rows_per_program(c: int) -> int:
  """The power of two <= ROW_ELEMENTS / C (at least 1)."""
  return 1 << max(0, (ROW_ELEMENTS // c).bit_length() - 1)


def _call(x, scale, shift, layer, eps: float, dtype, interpret: bool):
  """x [M, C] -> [M, C] in `dtype`; M need not divide by the rows per program."""
  (m, c), block_m = x.shape, _rows_per_program(x.shape[1])
  row_block = pl.BlockSpec((block_m, c), lambda i: (i, 0))
  whole = pl.BlockSpec(scale.shape, lambda i: (0, 0))
  return pl.pallas_call(
      functools.partial(_kernel, rows=m, chunk=_block(c, CHUNK_CHOICES), eps=eps),
      grid=(pl.cdiv(m, block_m),),
      in_specs=[pl.BlockSpec((1,), lambda i: (0,)), row_block, whole, whole],
      out_specs=row_block,
      out_shape=jax.ShapeDtypeStruct((m, c), dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4),
      interpret=interpret,
      name='layer_norm',
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), x, scale, shift)


def unsupported(x, scale) -> str:
  """Why the kernel does not take these shapes and dtypes ('' when it does)."""
  if x.dtype not in DTYPES or scale.dtype not in DTYPES:
    return f'dtypes x {x.dtype}, scale {scale.dtype}'
  if _block(x.shape[-1], CHUNK_CHOICES) is None:
    return f'C={x.shape[-1]} is not a multiple of {CHUNK_CHOICES[-1]}'
  if x.shape[-1] > MAX_C:
    return f'C={x.shape[-1]} is above {MAX_C}, the row a program holds in registers'
  return ''


def layer_norm(x: jax.Array, scale: jax.Array, shift: jax.Array, layer, *, eps: float, dtype=None,
               impl: str = 'auto') -> jax.Array:
  """flax's `nn.LayerNorm(epsilon=eps, use_fast_variance=False, dtype=dtype)` of x [..., C] with the
  parameters scale[layer] and shift[layer] (scale, shift [L, C]; `layer` an int scalar, traced or
  not) -> [..., C] in `dtype` (None: flax's, x's promoted with the parameters'). `impl`: as
  `dispatch.resolve` ('mosaic' is not built); 'auto' keeps the shapes `unsupported` names on the
  reference."""
  if scale.ndim != 2 or shift.shape != scale.shape or x.shape[-1] != scale.shape[1]:
    raise ValueError(f'layer_norm expects x [..., C], scale and shift [L, C]; got {x.shape}, {scale.shape}, '
                     f'{shift.shape}')
  if impl == 'auto' and unsupported(x, scale):
    impl = 'reference'
  impl = dispatch.resolve(impl, 'layer_norm has no Mosaic GPU kernel')
  if impl == 'reference':
    return reference(x, scale, shift, layer, eps, dtype)
  if why := unsupported(x, scale):
    raise ValueError(f'layer_norm kernel: {why}')
  out = _call(x.reshape(-1, x.shape[-1]), scale, shift, layer, eps, _out_dtype(x, scale, shift, dtype),
              impl == 'interpret')
  return out.reshape(x.shape)
