"""One layer's dense layer out of weights stacked on a layer axis, its weights read in place.

`layer_dense(x, w, b, layer)` = x @ w[layer] + b[layer] for x [M, K], w [L, K, N], b [L, N] (or
None) and `layer` an int32 scalar, traced inside a scan over the layers. XLA computes w[layer] as a
copy before its GEMM (benchmarks/RESULTS.md, "VAR's scanned sampler on the GPU"), which at few
rows moves the layer's weights three times instead of once; only cuBLAS, under XLA's dynamic-slice
fusion, reads it in place, and only for a GEMM without its bias in the epilogue (`reference`).
The Pallas kernel (Triton lowering) reads w[layer] straight from the stacked array: one program
per (row block, column block, part of K) walks its part of K a tile at a time into a float32
partial product (the last row block masks the rows past M: x is read as it is, not padded, which
would cost a copy of x per call); K is split where the column blocks alone are too few programs to
keep every SM streaming. The parts are summed and rounded to x's dtype, then the bias is added (as
flax's Dense adds it); with K in one part (splits=1) the kernel rounds and adds the bias itself:
one launch, no float32 partials.

'auto' runs the kernel on an NVIDIA GPU for at most AUTO_MAX_ROWS rows, where reading the layer's
slice in place beats XLA's GEMM of a copy of it; XLA's GEMM elsewhere (the reference), of the slice
in place where XLA's options allow it, of a copy otherwise. On Hopper, `layer_dense_mgpu.py` is the
same GEMM in the Mosaic GPU lowering (TMA loads of w[layer], wgmma); 'auto' takes it from
AUTO_MOSAIC_MIN_ROWS rows, off until a sampler runs faster with it (pallas_kernels/NOTES.md).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch, layer_dense_mgpu
from pallas_kernels.sparse_attention import row_mask

# Rows up to which 'auto' runs the kernel: at MAR-H's shapes it beats XLA's GEMM of a copy of the
# layer's slice at 320 and 640 rows in 7 of 8 cases (NOTES.md), and it takes no autotuning (LazyMAR's
# scanned MAR-H program compiles in 26 s alone against 35 s with XLA's GEMMs above 128 rows).
# Above, the GEMM is bound by its FLOPs and XLA's copy of the slice costs little beside it.
AUTO_MAX_ROWS = 640
# Rows from which 'auto' takes the Mosaic GPU kernel (`layer_dense_mgpu.py`) on a Hopper GPU, up to
# AUTO_MAX_ROWS (0: never; the Triton kernel).
AUTO_MOSAIC_MIN_ROWS = 0
BLOCK_K = 64
# Programs a call aims at (K split where the column blocks are fewer): about two per SM of an
# H100 (132), so that every SM streams weights.
TARGET_PROGRAMS = 264


BLOCK_N_CHOICES = (128, 64, 32, 16)   # the column block: the largest dividing N


def _plus_bias(y, b, layer):
  """y + b[layer] in y's dtype (b None: y)."""
  return y if b is None else y + lax.dynamic_index_in_dim(b, layer, 0, keepdims=False).astype(y.dtype)


def reference(x, w, b, layer):
  """x [M, K] @ w[layer] + b[layer] in x's dtype, through XLA. The GEMM is kept apart from the bias
  add (an optimization barrier): with XLA's dynamic-slice fusion on and its Triton GEMMs off, cuBLAS
  then reads w[layer] in place when `layer` is a loop's counter, where a GEMM with the bias in its
  epilogue reads a copy of the slice (benchmarks/RESULTS.md, "The scanned samplers' loop counter
  and GEMMs kept apart from their bias")."""
  y = x @ lax.dynamic_index_in_dim(w, layer, 0, keepdims=False).astype(x.dtype)
  return _plus_bias(lax.optimization_barrier(y), b, layer)


def _kernel(layer_ref, x_ref, w_ref, *refs, rows: int, block_n: int, block_k: int, steps: int, whole: bool):
  """One (row block, column block, part of K): its float32 partial product; `whole` (K in one
  part): the output itself, rounded to its dtype and the bias added (refs = ([b_ref,] o_ref)).
  Rows past `rows` (the last row block's overhang) are neither read nor written."""
  layer, col0, k0 = layer_ref[0], pl.program_id(1) * block_n, pl.program_id(2) * steps * block_k
  block_m = x_ref.shape[0]
  live = row_mask(pl.program_id(0) * block_m, block_m, rows, 2)   # [block_m, 1]

  def step(t, acc):
    x = plgpu.load(x_ref.at[:, pl.ds(k0 + t * block_k, block_k)], mask=live, other=0)
    w = plgpu.load(w_ref.at[layer, pl.ds(k0 + t * block_k, block_k), pl.ds(col0, block_n)])
    return acc + lax.dot_general(x, w.astype(x.dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

  acc, o_ref = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32)), refs[-1]
  if not whole:
    plgpu.store(o_ref, acc, mask=live)
    return
  y = acc.astype(o_ref.dtype)
  if len(refs) == 2:
    y = y + plgpu.load(refs[0].at[layer, pl.ds(col0, block_n)]).astype(y.dtype)[None, :]
  plgpu.store(o_ref, y, mask=live)


def _call(x, w, b, layer, interpret: bool, block_m: int, block_n: int, block_k: int, splits: int,
          num_warps: int, num_stages: int):
  """x [M, K]; K in `splits` equal parts: [splits, M, N] float32, their products (b unused); one
  part: x @ w[layer] + b[layer] [M, N] in x's dtype, in one launch. M need not divide by block_m."""
  (m, k), n, whole = x.shape, w.shape[2], splits == 1
  operands = [jnp.reshape(layer, (1,)).astype(jnp.int32), x, w] + ([b] if whole and b is not None else [])
  in_specs = [pl.BlockSpec((1,), lambda i, j, s: (0,)), pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0)),
              pl.BlockSpec(w.shape, lambda i, j, s: (0, 0, 0))]
  in_specs += [pl.BlockSpec(b.shape, lambda i, j, s: (0, 0))] if len(operands) == 4 else []
  if whole:
    out_spec = pl.BlockSpec((block_m, block_n), lambda i, j, s: (i, j))
    out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
  else:
    out_spec = pl.BlockSpec((pl.squeezed, block_m, block_n), lambda i, j, s: (s, i, j))
    out_shape = jax.ShapeDtypeStruct((splits, m, n), jnp.float32)
  return pl.pallas_call(
      functools.partial(_kernel, rows=m, block_n=block_n, block_k=block_k, steps=k // block_k // splits, whole=whole),
      grid=(pl.cdiv(m, block_m), n // block_n, splits),
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name='layer_dense',
  )(*operands)


def _splits(programs: int, k_steps: int) -> int:
  """The K splits that give about TARGET_PROGRAMS programs: the largest divisor of k_steps at most
  TARGET_PROGRAMS / programs."""
  want = max(1, TARGET_PROGRAMS // programs)
  return max(d for d in range(1, k_steps + 1) if k_steps % d == 0 and d <= want)


def _block(n: int, choices) -> Optional[int]:
  return next((c for c in choices if n % c == 0), None)


def unsupported(x, w) -> str:
  """Why the kernel does not take these shapes ('' when it does)."""
  if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    return f'x dtype {x.dtype}'
  if x.shape[1] % BLOCK_K:
    return f'K={x.shape[1]} is not a multiple of {BLOCK_K}'
  if _block(w.shape[2], BLOCK_N_CHOICES) is None:
    return f'N={w.shape[2]} is not a multiple of 16'
  return ''


def tiling_error(k: int, n: int, block_n: int, block_k: int, splits: int, block_m: int = 16) -> str:
  """Why a tiling does not fit K and N ('' when it does): block_m must be a multiple of 16, block_n
  divide N, block_k K, and splits the K // block_k blocks."""
  if block_m % 16:
    return f'block_m {block_m} is not a multiple of 16'
  if n % block_n or k % block_k or (k // block_k) % splits:
    return f'block_n {block_n} must divide N={n}, block_k {block_k} K={k}, splits {splits} the {k // block_k} K blocks'
  return ''


def _resolve(x2, w, impl: str) -> str:
  rows = x2.shape[0]
  if impl == 'auto' and (rows > AUTO_MAX_ROWS or unsupported(x2, w)):
    impl = 'reference'
  why = layer_dense_mgpu.unsupported(x2, w)
  if impl == 'auto' and not why and not 0 < AUTO_MOSAIC_MIN_ROWS <= rows:
    why = f"'auto' takes the Mosaic GPU kernel from AUTO_MOSAIC_MIN_ROWS={AUTO_MOSAIC_MIN_ROWS} rows"
  return dispatch.resolve(impl, why)


def _mosaic(x2, w, b, layer, tiling: Optional[layer_dense_mgpu.Tiling]):
  """The Mosaic GPU kernel on x2 [M, K] (its tiling chosen for the shape unless given): [M, N], or
  [splits, M, N] float32 partial products."""
  num_sms = jax.devices()[0].core_count
  tiling = tiling or layer_dense_mgpu.choose(*x2.shape, w.shape[2], num_sms)
  if why := layer_dense_mgpu.tiling_error(x2.shape[1], w.shape[2], tiling):
    raise ValueError(f'layer_dense Mosaic GPU tiling: {why}')
  return layer_dense_mgpu.layer_dense(x2, w, b, layer, tiling, num_sms)


def _triton(x2, w, b, layer, interpret: bool, block_m: int, block_n: int, block_k: int, splits: int,
            num_warps: int, num_stages: int):
  """The Triton-lowered kernel on x2 [M, K] (0: the tiling chosen as the module docstring says):
  [M, N], or [splits, M, N] float32 partial products."""
  if why := unsupported(x2, w):
    raise ValueError(f'layer_dense kernel: {why}')
  rows, n = x2.shape[0], w.shape[2]
  block_m = block_m or (16 if rows <= 16 else 64)
  block_n = block_n or _block(n, BLOCK_N_CHOICES)
  k_steps = x2.shape[1] // block_k
  splits = splits or _splits(pl.cdiv(rows, block_m) * n // block_n, k_steps)
  if why := tiling_error(x2.shape[1], n, block_n, block_k, splits, block_m):
    raise ValueError(f'layer_dense tiling: {why}')
  return _call(x2, w, b, layer, interpret, block_m, block_n, block_k, splits, num_warps, num_stages)


def layer_dense(x: jax.Array, w: jax.Array, b: Optional[jax.Array], layer, *, impl: str = 'auto',
                block_m: int = 0, block_n: int = 0, block_k: int = BLOCK_K, splits: int = 0, num_warps: int = 4,
                num_stages: int = 3, mosaic_tiling: Optional[layer_dense_mgpu.Tiling] = None) -> jax.Array:
  """x [..., K] @ w[layer] + b[layer] -> [..., N] in x's dtype; w [L, K, N], b [L, N] or None,
  `layer` an int scalar (traced or not). `impl`: as `dispatch.resolve`; 'auto' keeps more than
  AUTO_MAX_ROWS rows, and shapes `unsupported` names, on the reference, and takes the Mosaic GPU
  kernel on Hopper from AUTO_MOSAIC_MIN_ROWS rows. The tilings (0 / None: chosen for the shape;
  block_m 16 up to 16 rows, else 64) are for benchmarks: `block_m` a multiple of 16, `block_k`
  must divide K, `splits` K // block_k; `mosaic_tiling` the Mosaic GPU kernel's."""
  if w.ndim != 3 or x.shape[-1] != w.shape[1] or (b is not None and b.shape != (w.shape[0], w.shape[2])):
    raise ValueError(f'layer_dense expects x [..., K], w [L, K, N], b [L, N]; got {x.shape}, {w.shape}, '
                     f'{None if b is None else b.shape}')
  x2 = x.reshape(-1, x.shape[-1])
  impl = _resolve(x2, w, impl)
  if impl == 'reference':
    return reference(x, w, b, layer)
  if impl == 'mosaic':
    out = _mosaic(x2, w, b, layer, mosaic_tiling)
  else:
    out = _triton(x2, w, b, layer, impl == 'interpret', block_m, block_n, block_k, splits, num_warps, num_stages)
  if out.ndim == 3:   # the K parts' float32 products: summed, rounded, the bias added
    out = _plus_bias(out.sum(0).astype(x.dtype), b, layer)
  return out.reshape(*x.shape[:-1], w.shape[2])
