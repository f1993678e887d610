"""One layer's dense layer out of weights stacked on a layer axis, for Hopper, in Pallas' Mosaic
GPU lowering: x [M, K] @ w[layer] (+ b[layer]) with w [L, K, N] read in place by TMA.

The Triton-lowered kernel (`layer_dense.py`) reads w[layer] in place at 0.6-0.9 of the speed of
XLA's GEMMs of separate weights at 184-640 rows (pallas_kernels/NOTES.md); this one is a GEMM of
`dense_gelu_mgpu.py`'s organisation whose operand tiles come from the stacked array at a layer
read from memory at run time: a persistent warp-specialised GEMM, one CTA per SM walking output
tiles of [tile_m, 2 * tile_n] (and parts of K, `splits`), a producer warpgroup streaming
[tile_m, TILE_K] tiles of x and [TILE_K, 2 * tile_n] tiles of w[layer] through `stages`
shared-memory slots with TMA, two compute warpgroups each owning [tile_m, tile_n] on wgmma.
Rows past M are TMA's out-of-bounds box: read as zeros, never written. With K in one part the
epilogue rounds the float32 product to x's dtype and adds the bias there (as flax's Dense: the
product rounded, then the bias added); with `splits` parts it stores float32 partial products
[splits, M, N], which the caller sums.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dispatch, mosaic_gpu_api

TILE_K = 64
EPI = 64          # the epilogue stores [EPI, EPI] sub-tiles through two slots per warpgroup
SMEM_BYTES = dispatch.HOPPER_SMEM_BYTES


def _tiled(dtype) -> tuple:
  """Shared-memory tiling of a 128-byte-swizzled tile of `dtype`: rows of 128 bytes."""
  return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))


class Tiling(NamedTuple):
  tile_m: int   # rows of a tile (64 or 128: wgmma's M)
  tile_n: int   # columns of a compute warpgroup's half of a tile (64 or 128)
  splits: int   # parts of K, each one tile's pipeline
  stages: int   # operand slots in shared memory


def unsupported(x: jax.Array, w: jax.Array) -> str:
  """Why the kernel does not take x [M, K] and w [L, K, N] ('' when it does)."""
  if x.dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != x.dtype:
    return f'the Mosaic GPU layer_dense takes bfloat16 or float16 x and w alike, got {x.dtype}, {w.dtype}'
  if x.shape[0] % 8 or x.shape[1] % TILE_K or w.shape[2] % 128:
    return (f'the Mosaic GPU layer_dense takes M a multiple of 8 (its TMA tiling), K of {TILE_K} and N of 128, '
            f'got {x.shape[0]}, {x.shape[1]}, {w.shape[2]}')
  return ''


def tiling_error(k: int, n: int, tiling: Tiling) -> str:
  """Why `tiling` does not fit K and N ('' when it does)."""
  if tiling.tile_m not in (64, 128) or tiling.tile_n not in (64, 128):
    return f'tile_m and tile_n must be 64 or 128, got {tiling.tile_m}, {tiling.tile_n}'
  if n % (2 * tiling.tile_n) or (k // TILE_K) % tiling.splits:
    return f'2 x tile_n {2 * tiling.tile_n} must divide N={n}, splits {tiling.splits} the {k // TILE_K} K tiles'
  if _smem(tiling, 4 if tiling.splits > 1 else 2) > SMEM_BYTES:
    return f'{tiling} needs more than {SMEM_BYTES} bytes of shared memory'
  return ''


def _smem(tiling: Tiling, out_bytes: int) -> int:
  ring = tiling.stages * (tiling.tile_m + 2 * tiling.tile_n) * TILE_K * 2
  return ring + 2 * 2 * EPI * EPI * out_bytes


def choose(m: int, k: int, n: int, num_sms: int) -> Tiling:
  """The tiling of the least modelled time: waves of CTAs, each streaming its part of K at one
  SM's share of the GPU's GEMM rate, plus a pipeline fill per wave and, split, the float32 partial
  products written and read again."""
  k_tiles, best = k // TILE_K, None
  for tile_m in (64, 128):
    for tile_n in (64, 128):
      if n % (2 * tile_n):
        continue
      tiles = -(-m // tile_m) * (n // (2 * tile_n))
      for splits in (s for s in range(1, k_tiles + 1) if k_tiles % s == 0 and k_tiles // s >= 4):
        waves = -(-tiles * splits // num_sms)
        flops_us = tile_m * 2 * tile_n * (k // splits) * 2 / 5.0e6   # ~5 TFLOP/s a CTA
        partials_us = 0 if splits == 1 else splits * m * n * 4 * 2 / 3.0e6 + 2.0
        cost = waves * (flops_us + 1.0) + partials_us
        if best is None or cost < best[0]:
          best = (cost, Tiling(tile_m, tile_n, splits, 4))
  tiling = best[1]
  out_bytes = 4 if tiling.splits > 1 else 2
  while _smem(tiling, out_bytes) > SMEM_BYTES - 4096:
    tiling = tiling._replace(stages=tiling.stages - 1)
  return tiling


def _kernel(layer_ref, x_ref, w_ref, *refs, tiling: Tiling, m: int):
  """refs = ([b_ref,] o_ref): o [M, N] (one part of K) or [splits, M, N] float32."""
  tile_m, tile_n, splits, stages = tiling
  o_ref, b_ref = refs[-1], (refs[0] if len(refs) == 2 else None)
  k, n = x_ref.shape[1], w_ref.shape[2]
  k_part = k // splits
  m_tiles, n_tiles = -(-m // tile_m), n // (2 * tile_n)
  layer = layer_ref[0]

  def pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_part // TILE_K,), memory_registers=40, wg_axis='wg', num_compute_wgs=2,
        max_concurrent_steps=stages, compute_context=context,
        in_specs=[plgpu.BlockSpec((tile_m, TILE_K), lambda kk: (0, kk), transforms=_tiled(x_ref.dtype)),
                  plgpu.BlockSpec((TILE_K, 2 * tile_n), lambda kk: (kk, 0), transforms=_tiled(x_ref.dtype))])

  unused = lambda *_, **__: None

  @functools.partial(pl.run_scoped,
                     allocs=pipeline(unused, unused).get_allocations(x_ref, w_ref.at[0]),
                     out_smem=plgpu.SMEM((2, 2, EPI, EPI), o_ref.dtype, transforms=_tiled(o_ref.dtype)),
                     collective_axes='wg')
  def _(allocs, out_smem):
    wg = lax.axis_index('wg')

    @plgpu.nd_loop((m_tiles * n_tiles * splits,), collective_axes='sm')
    def _(info):
      (t,) = info.index
      part, mn = lax.div(t, m_tiles * n_tiles), lax.rem(t, m_tiles * n_tiles)
      mi, ni = lax.div(mn, n_tiles), lax.rem(mn, n_tiles)
      n0 = ni * (2 * tile_n) + wg * tile_n
      out = o_ref if splits == 1 else o_ref.at[part]

      def epilogue(run):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _(acc):
          run(acc)
          y = acc[...]
          if splits == 1:
            y = y.astype(o_ref.dtype)
            if b_ref is not None:
              bias = mosaic_gpu_api.load(b_ref.at[layer, pl.ds(n0, tile_n)],
                                         layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
              y = (y.astype(jnp.float32) + lax.broadcast_in_dim(bias.astype(jnp.float32), (tile_m, tile_n), [1])
                   ).astype(o_ref.dtype)
          sub_tiles = [(i, j) for i in range(tile_m // EPI) for j in range(tile_n // EPI)]
          for s, (i, j) in enumerate(sub_tiles):
            # Slot s % 2 was last read by the store two sub-tiles back (the first sub-tile waits for
            # every store of the previous tile: its count of sub-tiles may be odd).
            plgpu.wait_smem_to_gmem(1 if s else 0, wait_read_only=True)
            out_smem[wg, s % 2] = y[i * EPI:(i + 1) * EPI, j * EPI:(j + 1) * EPI]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg, s % 2], out.at[pl.ds(mi * tile_m + i * EPI, EPI),
                                                                   pl.ds(n0 + j * EPI, EPI)])

      def step(_, x_smem, w_smem, acc):
        plgpu.wgmma(acc, x_smem, w_smem.at[:, pl.ds(wg * tile_n, tile_n)])
        plgpu.wgmma_wait(0)
        return acc

      ks = pl.ds(part * k_part, k_part)
      pipeline(step, epilogue)(x_ref.at[pl.ds(mi * tile_m, tile_m), ks],
                               w_ref.at[layer, ks, pl.ds(ni * 2 * tile_n, 2 * tile_n)], allocations=allocs)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def layer_dense(x: jax.Array, w: jax.Array, b, layer, tiling: Tiling, num_sms: int) -> jax.Array:
  """x [M, K] @ w[layer] (+ b[layer] [N], with K in one part): [M, N] in x's dtype, or with
  `tiling.splits` parts [splits, M, N] float32 partial products (b unused). `layer` an int32
  scalar, traced or not; one CTA per SM of `num_sms`."""
  m, n = x.shape[0], w.shape[2]
  whole = tiling.splits == 1
  operands = [jnp.reshape(layer, (1,)).astype(jnp.int32), x, w] + ([b] if whole and b is not None else [])
  out_type = (jax.ShapeDtypeStruct((m, n), x.dtype) if whole
              else jax.ShapeDtypeStruct((tiling.splits, m, n), jnp.float32))
  return plgpu.kernel(
      functools.partial(_kernel, tiling=tiling, m=m),
      out_type=out_type, grid=(num_sms,), grid_names=('sm',), num_threads=3,
      thread_name='wg', compiler_params=mosaic_gpu_api.compiler_params(approx_math=True),
  )(*operands)
