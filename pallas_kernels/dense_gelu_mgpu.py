"""A transformer's fc1, bias and tanh-GELU as one GEMM for Hopper, in Pallas' Mosaic GPU lowering.

y = gelu_tanh(x @ w + b): float32 accumulation, the bias and the GELU applied to the
accumulator, one rounding to the output dtype. XLA runs the GELU as a separate pass
over the [M, 4C] activation (its GEMM rewriter fuses no GELU epilogue here, RESULTS.md);
this kernel never writes the pre-activation.

Organisation: a persistent warp-specialised GEMM. One CTA per SM walks output tiles
of [TILE_M, 2 * TILE_N] in a snake order that keeps a band of GRID_WIDTH row tiles
hot in L2; a producer warpgroup streams [TILE_M, TILE_K] and [TILE_K, 2 * TILE_N]
operand tiles through STAGES shared-memory slots with TMA; two compute warpgroups
each own [TILE_M, TILE_N] of the tile on wgmma, then add the bias, apply the GELU
and store [EPI, EPI] sub-tiles through two shared-memory slots with TMA, the last
stores overlapping the next tile.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu_api

TILE_M, TILE_N, TILE_K = 128, 128, 64
EPI = 64          # the epilogue stores [EPI, EPI] sub-tiles through two slots per warpgroup
STAGES = 4        # operand ring slots: 4 x 48 KiB beside the 32 KiB of output slots
GRID_WIDTH = 8    # row tiles per band of the snake order
DELAY_RELEASE = 0  # k steps a wgmma may stay in flight before its operand slot is released
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# gelu_tanh(h) = h * sigmoid(2u), u = sqrt(2/pi) (h + 0.044715 h^3): exp2 in place of tanh.
_GELU_2U_LOG2E = 2.0 * math.sqrt(2.0 / math.pi) * math.log2(math.e)


def unsupported(x: jax.Array, w: jax.Array) -> str:
  """Why the kernel does not take x [M, K] and w [K, N] ('' when it does)."""
  if x.dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != x.dtype:
    return f'the Mosaic GPU dense-GELU takes bfloat16 or float16 x and w alike, got {x.dtype}, {w.dtype}'
  if x.shape[0] % TILE_M or x.shape[1] % TILE_K or w.shape[1] % (2 * TILE_N):
    return (f'the Mosaic GPU dense-GELU takes M, K, N multiples of {TILE_M}, {TILE_K}, '
            f'{2 * TILE_N}; got {x.shape[0]}, {x.shape[1]}, {w.shape[1]}')
  return ''


def _gelu(h):
  return h / (1.0 + jnp.exp2(-_GELU_2U_LOG2E * (h + 0.044715 * (h * h * h))))


def _kernel(x_ref, w_ref, b_ref, o_ref, *, m_tiles: int, n_tiles: int, stages: int, grid_width: int,
            delay_release: int):
  k_tiles = x_ref.shape[1] // TILE_K

  def pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_tiles,), memory_registers=40, wg_axis='wg', num_compute_wgs=2,
        max_concurrent_steps=stages, compute_context=context,
        in_specs=[plgpu.BlockSpec((TILE_M, TILE_K), lambda k: (0, k), transforms=TILED,
                                  delay_release=delay_release),
                  plgpu.BlockSpec((TILE_K, 2 * TILE_N), lambda k: (k, 0), transforms=TILED,
                                  delay_release=delay_release)])

  unused = lambda *_, **__: None

  @functools.partial(pl.run_scoped,
                     allocs=pipeline(unused, unused).get_allocations(x_ref, w_ref),
                     out_smem=plgpu.SMEM((2, 2, EPI, EPI), o_ref.dtype, transforms=TILED),
                     collective_axes='wg')
  def _(allocs, out_smem):
    wg = lax.axis_index('wg')

    @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes='sm')
    def _(info):
      (t,) = info.index
      mi, ni = plgpu.planar_snake(t, (m_tiles, n_tiles), 0, min(grid_width, m_tiles))
      rows = pl.ds(mi * TILE_M, TILE_M)
      n0 = ni * (2 * TILE_N) + wg * TILE_N

      def epilogue(run):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((TILE_M, TILE_N), jnp.float32))
        def _(acc):
          run(acc)
          bias = mosaic_gpu_api.load(b_ref.at[pl.ds(n0, TILE_N)], layout=plgpu.Layout.WGMMA.reduce(0),
                                     optimized=False)
          y = _gelu(acc[...] + lax.broadcast_in_dim(bias, (TILE_M, TILE_N), [1])).astype(o_ref.dtype)
          for i in range(TILE_M // EPI):
            for j in range(TILE_N // EPI):
              plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # slot j's last store has read it
              out_smem[wg, j] = y[i * EPI:(i + 1) * EPI, j * EPI:(j + 1) * EPI]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(out_smem.at[wg, j], o_ref.at[pl.ds(mi * TILE_M + i * EPI, EPI),
                                                                   pl.ds(n0 + j * EPI, EPI)])

      def step(_, x_smem, w_smem, acc):
        plgpu.wgmma(acc, x_smem, w_smem.at[:, pl.ds(wg * TILE_N, TILE_N)])
        plgpu.wgmma_wait(delay_release)
        return acc

      pipeline(step, epilogue)(x_ref.at[rows, :], w_ref.at[:, pl.ds(ni * 2 * TILE_N, 2 * TILE_N)],
                               allocations=allocs)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# jit: a model calling this in every layer lowers the kernel once per shape, not once per call.
@functools.partial(jax.jit, static_argnames=('stages', 'grid_width', 'delay_release', 'num_sms'))
def dense_gelu(x: jax.Array, w: jax.Array, b: jax.Array, *, stages: int = STAGES,
               grid_width: int = GRID_WIDTH, delay_release: int = DELAY_RELEASE,
               num_sms: int | None = None) -> jax.Array:
  """gelu_tanh(x @ w + b): x [M, K], w [K, N] (see `unsupported`), b [N] -> [M, N] in x's dtype.

  `stages`, `grid_width`, `delay_release`: see the module constants of those names; one CTA per SM
  of `num_sms` (None: the device's).
  """
  reason = unsupported(x, w)
  if reason:
    raise ValueError(reason)
  m, n = x.shape[0], w.shape[1]
  num_sms = num_sms or jax.devices()[0].core_count
  return plgpu.kernel(
      functools.partial(_kernel, m_tiles=m // TILE_M, n_tiles=n // (2 * TILE_N), stages=stages,
                        grid_width=grid_width, delay_release=delay_release),
      out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
      grid=(num_sms,), grid_names=('sm',), num_threads=3, thread_name='wg',
      compiler_params=mosaic_gpu_api.compiler_params(approx_math=True),
  )(x, w, b.astype(jnp.float32))
