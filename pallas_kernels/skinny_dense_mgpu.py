"""A dense layer on a few rows whose weights stream in while the kernel before it still runs
(Hopper, Pallas' Mosaic GPU lowering, programmatic dependent launch).

On the 2-32 rows of a batch-1 denoiser step a GEMM is a pass over its weights, and each of XLA's
takes ~3.5 us for 4.7 MB (MAR-H's head, pallas_kernels/NOTES.md), twice the time the bytes take
at the HBM's rate: every launch pays a DRAM latency and a ramp before its weights flow. The
weights do not depend on the rows, so here each CTA issues the TMA copies of its weight tiles
first, signals that the next kernel may launch (`griddepcontrol.launch_dependents`), and only then
waits for the kernel before it (`griddepcontrol.wait`) to read its rows: in a chain of these
kernels the next one's weights are in flight while this one computes.

Rows are kept transposed and split: a chain passes partial sums p [S, K, Rp] float32 (S parts of
K, Rp the rows padded to 16 or 32), which the next kernel adds up (in a fixed order), applies its
activation to, and rounds to bfloat16 as the B operand of wgmma (N = Rp); the weights' [64, 64]
tiles are the A operand (64 output columns, read transposed in the descriptor). One CTA per (64
output columns, 1/S of K).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dispatch

TILE = 64            # output columns per CTA (wgmma's M) and K per weight tile
MAX_ROWS = 32        # rows a call takes (padded to 16 or 32: wgmma's N)
SMEM_BYTES = dispatch.HOPPER_SMEM_BYTES
ACTIVATIONS = {'none': lambda h: h, 'silu': lambda h: h / (1.0 + jnp.exp(-h))}


def tiled(rows_padded: int):
  """Shared-memory transforms of bf16 tiles beside a B operand of Rp columns: the B rows' bytes set
  the swizzle both wgmma operands share."""
  return (plgpu.TilingTransform((8, rows_padded)), plgpu.SwizzleTransform(2 * rows_padded))


def splits_for(k: int, n: int, num_sms: int) -> int:
  """Parts S of K: the most with N / 64 x S CTAs on `num_sms` SMs, each part whole tiles (0: none)."""
  fits = [s for s in range(1, num_sms // max(n // TILE, 1) + 1) if k % (s * TILE) == 0]
  return max(fits, default=0)


def unsupported(p: jax.Array, w: jax.Array, num_sms: int) -> str:
  """Why the kernel does not take partial sums p [S_in, K, Rp] and weights w [K, N] ('' if it does)."""
  if not num_sms:
    return 'the skinny dense kernel runs on an NVIDIA Hopper GPU (Mosaic GPU)'
  if p.ndim != 3 or p.shape[2] not in (16, 32) or p.dtype != jnp.float32:
    return f'the skinny dense kernel takes float32 partial sums [S, K, 16 or 32], got {p.dtype}{list(p.shape)}'
  if w.dtype != jnp.bfloat16 or w.shape[0] != p.shape[1] or w.shape[0] % TILE or w.shape[1] % TILE:
    return (f'the skinny dense kernel takes bfloat16 weights [K, N] with K = {p.shape[1]} and both multiples of '
            f'{TILE}, got {w.dtype}{list(w.shape)}')
  splits = splits_for(*w.shape, num_sms)
  if not splits:
    return f'{w.shape[1] // TILE} column blocks need more CTAs than {num_sms} SMs hold at once'
  smem = w.shape[0] // splits * (TILE + p.shape[2]) * 2
  if smem > SMEM_BYTES:
    return (f'a CTA holds its {w.shape[0] // splits} rows of K of the weights and the rows at once: {smem} bytes of '
            f'shared memory for w {list(w.shape)} in {splits} parts, more than {SMEM_BYTES}')
  return ''


def head_start(w_ref, k0, n0, w_smem, bars, pdl: bool):
  """The weights first: w_ref's [64, 64] tiles at rows k0, k0 + 64, ... (as many as w_smem holds) and
  columns n0 .. n0 + 63 copied into w_smem by TMA, tile j arriving on bars[j]; then (`pdl`) the next
  kernel is let in and the one ahead waited for, after which the rows may be read."""
  for j in range(w_smem.shape[0]):
    plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k0 + j * TILE, TILE), pl.ds(n0, TILE)], w_smem.at[j], bars.at[j])
  if pdl:
    plgpu.griddepcontrol_launch_dependents()
    plgpu.griddepcontrol_wait()


def _kernel(p_ref, w_ref, o_ref, w_smem, x_smem, bars, *, splits: int, activation: str, pdl: bool):
  k, rp = p_ref.shape[1:]
  tiles = k // splits // TILE
  cta = lax.axis_index('cta')
  n0, k0 = (cta // splits) * TILE, (cta % splits) * (k // splits)
  head_start(w_ref, k0, n0, w_smem, bars, pdl)
  for j in range(tiles):
    rows = [plgpu.load(p_ref.at[t, pl.ds(k0 + j * TILE, TILE), :], (), layout=plgpu.Layout.WGMMA, optimized=False)
            for t in range(p_ref.shape[0])]
    x_smem[j] = ACTIVATIONS[activation](sum(rows[1:], rows[0])).astype(x_smem.dtype)
  plgpu.commit_smem()

  @functools.partial(pl.run_scoped, acc=plgpu.ACC((TILE, rp), jnp.float32))
  def _(acc):
    for j in range(tiles):
      plgpu.barrier_wait(bars.at[j])
      plgpu.wgmma(acc, plgpu.transpose_ref(w_smem.at[j], (1, 0)), x_smem.at[j])
    plgpu.wgmma_wait(0)
    o_ref.at[cta % splits, pl.ds(n0, TILE), :][...] = acc[...]


def skinny_dense(p: jax.Array, w: jax.Array, *, activation: str = 'none', num_sms: int, pdl: bool = True) -> jax.Array:
  """activation(sum_s p[s]) @ w as partial sums: p [S_in, K, Rp] float32 (rows transposed), w [K, N]
  bfloat16 -> [S, N, Rp] float32, S = `splits_for(K, N, num_sms)` parts of K (their sum is the
  product; a chain hands them to the next call as they are). `pdl` False: launched after the kernel
  before it ends, as any kernel (the weights' head start measured apart). See `unsupported`."""
  reason = unsupported(p, w, num_sms)
  if reason:
    raise ValueError(reason)
  if activation not in ACTIVATIONS:
    raise ValueError(f'activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}')
  (k, n), rp = w.shape, p.shape[2]
  splits = splits_for(k, n, num_sms)
  tiles = k // splits // TILE
  return plgpu.kernel(
      functools.partial(_kernel, splits=splits, activation=activation, pdl=pdl),
      out_type=jax.ShapeDtypeStruct((splits, n, rp), jnp.float32),
      scratch_types=[plgpu.SMEM((tiles, TILE, TILE), w.dtype, transforms=tiled(rp)),
                      plgpu.SMEM((tiles, TILE, rp), w.dtype, transforms=tiled(rp)),
                      plgpu.Barrier(num_barriers=tiles)],
      grid=(n // TILE * splits,), grid_names=('cta',),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(p, w)


def reference(p: jax.Array, w: jax.Array, activation: str = 'none') -> jax.Array:
  """activation(sum_s p[s]) @ w [N, Rp] float32, the rows rounded to w's dtype as the kernel's
  B operand is (the sum of its partial sums)."""
  x = ACTIVATIONS[activation](p.sum(0)).astype(w.dtype)
  return jnp.einsum('kn,kr->nr', w, x, preferred_element_type=jnp.float32)
