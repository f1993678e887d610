"""MAR's DiffLoss res blocks of one sampling step on a few rows, as one persistent Mosaic GPU kernel.

Each block: x + gate * fc2(SiLU(fc1(modulate(LN(x), scale, shift)))), with (shift, scale, gate)
the block's adaLN outputs given per row. On the 2-32 rows of a batch-1 sampling step a block is
two passes over its weights, which XLA runs as five launches of a few microseconds each (~12 us a
block of MAR-H's head against 2.6 us of weights, pallas_kernels/NOTES.md). Here every block of
the step runs in one launch. Measured on an H200 (NOTES.md, "MAR's DiffLoss step as one
persistent kernel"): ~158 us for MAR-H's 12 blocks at 8-16 rows, about what XLA takes; no sampler
selects it yet.

Organisation: one CTA per (64 output columns, 1/S of K) of a GEMM, C / 64 x S CTAs resident at
once, which meet at grid-wide barriers (a global semaphore counting arrivals). The rows live
transposed, [C, Rp] float32 (Rp = the rows padded to 16 or 32), so each GEMM is the weights as
wgmma's 64-row A operand (read in place, transposed in the descriptor) times the rows as a narrow
N = Rp B operand; a GEMM's weight tiles and the tiles its B operand is computed from are all in
flight at once (one TMA pipeline). Per block, three phases between barriers:
  A  every CTA: each row's LayerNorm statistics, merged from the column blocks' (Chan et al.);
     its K-slice of modulate(LN(x)); fc1's partial sums for its 64 columns -> p1[s];
  B  every CTA: SiLU(sum_s p1[s] + b1) of its K-slice; fc2's partial sums -> p2[s];
  C  the s = 0 CTA of each column block: x += gate * (sum_s p2[s] + b2) for its 64 channels,
     and those channels' mean and M2 of each row.
Split-K partial sums are added in a fixed order: the result does not vary from run to run.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dispatch

TILE = 64                    # output columns per CTA (wgmma's M) and K per pipeline step
PIPELINE_BYTES = 200 * 1024  # shared memory for the tiles in flight (of 227 KiB on Hopper)
MAX_ROWS = 32                # rows a call takes (padded to 16 or 32: wgmma's N)
WGMMA = plgpu.Layout.WGMMA


def _tiled(rows_padded: int, itemsize: int = 2):
  """Shared-memory transforms of a [K, Rp] tile of `itemsize`-byte elements: rows of Rp elements
  swizzled whole (bf16 operands, and the weights' tiles beside them: wgmma's A and B take one
  swizzle; float32 activations)."""
  return (plgpu.TilingTransform((8, rows_padded)), plgpu.SwizzleTransform(itemsize * rows_padded))


def splits_for(width: int, num_sms: int) -> int:
  """K splits S of a GEMM of width `width`: the most with width / 64 x S CTAs on `num_sms` SMs
  and each K-slice a multiple of 64 (0 when none fits)."""
  nt = width // TILE
  fits = [s for s in range(1, num_sms // max(nt, 1) + 1) if width % (s * TILE) == 0]
  return max(fits, default=0)


def unsupported(x: jax.Array, w1: jax.Array, num_sms: int) -> str:
  """Why the kernel does not take rows x [R, C] and stacked weights w1 [D, C, C] on a GPU of
  `num_sms` SMs ('' when it does)."""
  r, c = x.shape
  if not num_sms:
    return 'the fused DiffLoss blocks run on an NVIDIA Hopper GPU (Mosaic GPU)'
  if r > MAX_ROWS:
    return f'the fused DiffLoss blocks take at most {MAX_ROWS} rows, got {r}'
  if c % TILE or w1.shape[1:] != (c, c):
    return (f'the fused DiffLoss blocks take a width that is a multiple of {TILE} and [D, C, C] '
            f'weights, got x {x.shape}, w1 {w1.shape}')
  if w1.dtype != jnp.bfloat16:
    return f'the fused DiffLoss blocks take bfloat16 weights, got {w1.dtype}'
  if not splits_for(c, num_sms):
    return f'width {c} needs {c // TILE} CTAs resident at once, more than {num_sms} SMs'
  return ''


def _load(ref, layout, optimized=False):
  return plgpu.load(ref, (), layout=layout, optimized=optimized)


def _kernel(x0_ref, mods_ref, w1_ref, b1_ref, w2_ref, b2_ref, g_ref, be_ref,
            x_ref, p1_ref, p2_ref, stats_ref, xm_smem, *, splits: int, eps: float):
  c, rp = x_ref.shape
  depth = w1_ref.shape[0]
  nt = c // TILE
  ks = c // splits
  n_ctas = nt * splits
  cta = lax.axis_index('cta')
  n, s = cta // splits, cta % splits
  n0, k0 = n * TILE, s * ks
  sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
  rows = lambda v: lax.broadcast_in_dim(v, (TILE, rp), [1])
  channels = lambda v: lax.broadcast_in_dim(v, (TILE, rp), [0])
  gmem_chunk = lambda ref, c0: _load(ref.at[pl.ds(c0, TILE), :], WGMMA)
  vector = lambda ref: channels(_load(ref, WGMMA.reduce(1)))   # a [64] ref along the channels
  tile = lambda smem: _load(smem, WGMMA, optimized=True)
  tile_spec = plgpu.BlockSpec((TILE, rp), lambda k: (k, 0), transforms=_tiled(rp, 4))
  mods_spec = plgpu.BlockSpec((TILE, rp), lambda k: (k, 0), transforms=_tiled(rp))
  w_bytes, vector_bytes = TILE * TILE * 2, TILE * 4
  vector_spec = plgpu.BlockSpec((TILE,), lambda k: (k,))

  def barrier(k):   # the k-th grid-wide barrier of this call (k from 0)
    plgpu.semaphore_signal(sem, 1, memory_scope='gpu')
    pl.semaphore_wait(sem, n_ctas * (k + 1), decrement=False)

  def gemm(w_ref, out_ref, operand, specs, refs, step_bytes):
    """out_ref[s, n0:n0 + 64] = w_ref[k0:k0 + ks, n0:n0 + 64]^T @ B: [64, Rp] float32, where B's
    rows k0 + 64 k .. are operand(*tiles) [64, Rp] of the k-th tiles of refs (by specs). Every
    step's tiles are in flight at once."""
    @functools.partial(pl.run_scoped, acc=plgpu.ACC((TILE, rp), jnp.float32))
    def _(acc):
      def step(_, w_smem, *tiles):
        xm_smem[...] = operand(*tiles).astype(xm_smem.dtype)
        plgpu.commit_smem()
        plgpu.wgmma(acc, plgpu.transpose_ref(w_smem, (1, 0)), xm_smem)
        plgpu.wgmma_wait(0)

      plgpu.emit_pipeline(
          step, grid=(ks // TILE,), max_concurrent_steps=min(ks // TILE, PIPELINE_BYTES // step_bytes),
          in_specs=[plgpu.BlockSpec((TILE, TILE), lambda k: (k, 0), transforms=_tiled(rp)), *specs],
      )(w_ref.at[pl.ds(k0, ks), pl.ds(n0, TILE)], *refs)
      out_ref.at[s, pl.ds(n0, TILE), :][...] = acc[...]

  def owner_writes(x):
    """Column block n's rows x [64, Rp] into the state, with their mean and M2 over its channels."""
    x_ref.at[pl.ds(n0, TILE), :][...] = x
    m = jnp.sum(x, axis=0) / TILE
    d = x - rows(m)
    stats_ref.at[n, 0][...] = rows(m)
    stats_ref.at[n, 1][...] = rows(jnp.sum(d * d, axis=0))

  @pl.when(s == 0)
  def _():
    owner_writes(gmem_chunk(x0_ref, n0))
  barrier(0)

  def block(i, carry):
    # A: every row's LayerNorm statistics merged from the column blocks' (Chan et al.); fc1's
    # partial sums of this K-slice of modulate(LN(x)).
    means = [_load(stats_ref.at[j, 0, 0], WGMMA.reduce(0)) for j in range(nt)]
    m2s = [_load(stats_ref.at[j, 1, 0], WGMMA.reduce(0)) for j in range(nt)]
    mean = sum(means[1:], means[0]) / nt
    m2 = sum(m2s[1:], m2s[0]) + TILE * sum((m - mean) * (m - mean) for m in means)
    mean, rstd = rows(mean), rows(lax.rsqrt(m2 / c + eps))
    mods = mods_ref.at[pl.ds(i * 3 * c, 3 * c)]

    def modulated(x, shift, scale, g, be):
      h = (tile(x) - mean) * rstd * vector(g) + vector(be)
      return h * (1.0 + tile(scale).astype(jnp.float32)) + tile(shift).astype(jnp.float32)

    gemm(w1_ref.at[i], p1_ref, modulated, [tile_spec] + [mods_spec] * 2 + [vector_spec] * 2,
         [x_ref.at[pl.ds(k0, ks)], mods.at[pl.ds(k0, ks)], mods.at[pl.ds(c + k0, ks)],
          g_ref.at[i, pl.ds(k0, ks)], be_ref.at[i, pl.ds(k0, ks)]],
         w_bytes + TILE * rp * 8 + 2 * vector_bytes)
    barrier(3 * i + 1)

    # B: fc2's partial sums of this K-slice of SiLU(fc1's output).
    def activated(p1, b1):
      h = vector(b1)
      for t in range(splits):
        h = h + tile(p1.at[t])
      return h / (1.0 + jnp.exp(-h))

    p1_spec = plgpu.BlockSpec((splits, TILE, rp), lambda k: (0, k, 0), transforms=_tiled(rp, 4))
    gemm(w2_ref.at[i], p2_ref, activated, [p1_spec, vector_spec],
         [p1_ref.at[:, pl.ds(k0, ks)], b1_ref.at[i, pl.ds(k0, ks)]],
         w_bytes + splits * TILE * rp * 4 + vector_bytes)
    barrier(3 * i + 2)

    # C: the residual, by one CTA per 64 channels.
    @pl.when(s == 0)
    def _():
      parts = [gmem_chunk(p2_ref.at[t], n0) for t in range(splits)]
      x, gate = gmem_chunk(x_ref, n0), gmem_chunk(mods, 2 * c + n0).astype(jnp.float32)
      y = sum(parts[1:], parts[0]) + vector(b2_ref.at[i, pl.ds(n0, TILE)])
      owner_writes(x + gate * y)
    barrier(3 * i + 3)
    return carry

  lax.fori_loop(0, depth, block, None)
  # One arrival more than the last barrier needs: CTA 0 returns the count to 0 only after every
  # CTA has left that barrier's wait.
  plgpu.semaphore_signal(sem, 1, memory_scope='gpu')

  @pl.when(cta == 0)
  def _():
    pl.semaphore_wait(sem, n_ctas * (3 * depth + 2))


def device_sms() -> int:
  """SMs of the default device if it is a Hopper GPU, else 0 (wgmma is Hopper's)."""
  return jax.devices()[0].core_count if dispatch.is_hopper() else 0


@functools.partial(jax.jit, static_argnames=('eps', 'num_sms'))
def diffloss_blocks(x: jax.Array, mods: jax.Array, w1: jax.Array, b1: jax.Array, w2: jax.Array,
                    b2: jax.Array, ln_scale: jax.Array, ln_bias: jax.Array, *, eps: float = 1e-6,
                    num_sms: int | None = None) -> jax.Array:
  """The D res blocks of a DiffLoss step on rows x [R, C] -> [R, C] in x's dtype.

  mods [R, >= 3 D C]: each block's adaLN outputs (shift, scale, gate), block after block (the
  merged adaLN GEMM's output, `var_models.mar.diffloss.merged_adaln`); w1, w2 [D, C, C] (Dense
  kernels, [in, out]), b1, b2, ln_scale, ln_bias [D, C]. See `unsupported`; float32 arithmetic
  except the GEMMs' bf16 operands. num_sms: the GPU's (default: the default device's).
  """
  num_sms = device_sms() if num_sms is None else num_sms
  reason = unsupported(x, w1, num_sms)
  if reason:
    raise ValueError(reason)
  (r, c), depth = x.shape, w1.shape[0]
  want = {'w2': (depth, c, c), 'b1': (depth, c), 'b2': (depth, c), 'ln_scale': (depth, c), 'ln_bias': (depth, c)}
  got = {'w2': w2.shape, 'b1': b1.shape, 'b2': b2.shape, 'ln_scale': ln_scale.shape, 'ln_bias': ln_bias.shape}
  bad = [f'{k} {got[k]} (want {v})' for k, v in want.items() if got[k] != v]
  if mods.shape[0] != r or mods.shape[1] < 3 * depth * c:
    bad.insert(0, f'mods {mods.shape} (want ({r}, >= {3 * depth * c}))')
  if bad:
    raise ValueError(f'the fused DiffLoss blocks on x {x.shape} and w1 {w1.shape} got ' + ', '.join(bad))
  rp = 16 if r <= 16 else 32
  splits = splits_for(c, num_sms)
  transposed = lambda a, dtype: jnp.pad(a.astype(dtype).T, ((0, 0), (0, rp - r)))
  f32 = lambda a: a.astype(jnp.float32)
  partial_sums = jax.ShapeDtypeStruct((splits, c, rp), jnp.float32)
  out = plgpu.kernel(
      functools.partial(_kernel, splits=splits, eps=eps),
      out_type=(jax.ShapeDtypeStruct((c, rp), jnp.float32), partial_sums, partial_sums,
                jax.ShapeDtypeStruct((c // TILE, 2, TILE, rp), jnp.float32)),
      scratch_types=[plgpu.SMEM((TILE, rp), w1.dtype, transforms=_tiled(rp))],
      grid=(c // TILE * splits,), grid_names=('cta',),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(transposed(x, jnp.float32), transposed(mods[:, :3 * depth * c], w1.dtype), w1, f32(b1),
    w2.astype(w1.dtype), f32(b2), f32(ln_scale), f32(ln_bias))[0]
  return out[:, :r].T.astype(x.dtype)
