"""MAR's DiffLoss res blocks of one sampling step on a few rows, as one persistent Mosaic GPU kernel.

Each block: x + gate * fc2(SiLU(fc1(LN(x) * (1 + scale)) + shift_w)), with (shift_w, scale,
gate) the block's adaLN outputs given per row as the head's merged adaLN GEMM gives them
(shift_w: the shift through fc1's kernel). On the 2-16 rows of a batch-1 sampling step a block is
two passes over its weights, which XLA runs as five launches of a few microseconds each (~12 us a
block of MAR-H's head against 2.6 us of weights, pallas_kernels/NOTES.md). Here every block of
the step runs in one launch, and no GEMM waits for its weights: each CTA copies its share of the
next block's fc1 (fc2) weights into shared memory as soon as this block's fc1 (fc2) is done with
its slot, so the copies stream while the CTAs meet at the grid barriers in between.

Organisation: one CTA per (64 output columns, 1/S of K) of a GEMM, C / 64 x S CTAs resident at
once, which meet at grid-wide barriers (a global semaphore counting arrivals). The rows live
transposed, [C, 16] float32 (the rows padded to 16), so each GEMM is the weights as wgmma's 64-row
A operand (transposed in the descriptor) times the rows as an N = 16 B operand. Per block, three
phases between barriers:
  A  every CTA: each row's LayerNorm statistics, merged from the column blocks' (Chan et al.);
     its K-slice of LN(x) * (1 + scale); fc1's partial sums for its 64 columns -> p1[s];
  B  every CTA: SiLU(sum_s p1[s] + b1 + shift_w) of its K-slice; fc2's partial sums -> p2[s];
  C  the s = 0 CTA of each column block: x += gate * (sum_s p2[s] + b2) for its 64 channels,
     and those channels' mean and M2 of each row.
A phase's activation tiles are all copied at its start (TMA), and each tile's wgmma is issued as
soon as its B operand is in shared memory; one wait ends the phase. Split-K partial sums are
added in a fixed order: the result does not vary from run to run.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dispatch

TILE = 64                    # output columns per CTA (wgmma's M) and K per tile
ROWS = 16                    # rows a call takes, padded to 16 (wgmma's N)
SMEM_BYTES = dispatch.HOPPER_SMEM_BYTES
WGMMA = plgpu.Layout.WGMMA


def _tiled(itemsize: int = 2):
  """Shared-memory transforms of a [K, 16] tile of `itemsize`-byte elements: rows of 16 elements
  swizzled whole (bf16 operands, and the weights' tiles beside them: wgmma's A and B take one
  swizzle; float32 activations)."""
  return (plgpu.TilingTransform((8, ROWS)), plgpu.SwizzleTransform(itemsize * ROWS))


def splits_for(width: int, num_sms: int) -> int:
  """K splits S of a GEMM of width `width`: the most with width / 64 x S CTAs on `num_sms` SMs
  and each K-slice a multiple of 64 (0 when none fits)."""
  nt = width // TILE
  fits = [s for s in range(1, num_sms // max(nt, 1) + 1) if width % (s * TILE) == 0]
  return max(fits, default=0)


def smem_bytes(width: int, splits: int) -> int:
  """Shared memory a CTA holds at once: both GEMMs' weight slots, the B operand, phase B's partial
  sums and shifts (the larger of the phases' activation buffers)."""
  tiles = width // splits // TILE
  return 2 * tiles * TILE * TILE * 2 + 2 * tiles * TILE * ROWS * 2 + width * ROWS * 4


def unsupported(x: jax.Array, w1: jax.Array, num_sms: int) -> str:
  """Why the kernel does not take rows x [R, C] and stacked weights w1 [D, C, C] on a GPU of
  `num_sms` SMs ('' when it does)."""
  r, c = x.shape
  if not num_sms:
    return 'the fused DiffLoss blocks run on an NVIDIA Hopper GPU (Mosaic GPU)'
  if r > ROWS:
    return f'the fused DiffLoss blocks take at most {ROWS} rows, got {r}'
  if c % TILE or w1.shape[1:] != (c, c):
    return (f'the fused DiffLoss blocks take a width that is a multiple of {TILE} and [D, C, C] '
            f'weights, got x {x.shape}, w1 {w1.shape}')
  if w1.dtype != jnp.bfloat16:
    return f'the fused DiffLoss blocks take bfloat16 weights, got {w1.dtype}'
  splits = splits_for(c, num_sms)
  if not splits:
    return f'width {c} needs {c // TILE} CTAs resident at once, more than {num_sms} SMs'
  if smem_bytes(c, splits) > SMEM_BYTES:
    return (f'width {c} in {splits} K-slices needs {smem_bytes(c, splits)} bytes of shared memory a CTA, '
            f'more than {SMEM_BYTES}')
  return ''


def _load(ref, layout, optimized=False):
  return plgpu.load(ref, (), layout=layout, optimized=optimized)


def _kernel(first_ref, x0_ref, mods_ref, w1_ref, b1_ref, w2_ref, b2_ref, g_ref, be_ref,
            x_ref, p1_ref, p2_ref, stats_ref, w_smem, xm_smem, w_bars, a_bars, b_bars, *, splits: int,
            eps: float, count: int, unroll: bool):
  c = x_ref.shape[0]
  first = first_ref[0]          # this call's blocks: first .. first + count - 1 of the stacks
  nt = c // TILE
  ks = c // splits
  tiles = ks // TILE
  n_ctas = nt * splits
  cta = lax.axis_index('cta')
  n, s = cta // splits, cta % splits
  n0, k0 = n * TILE, s * ks
  sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
  rows = lambda v: lax.broadcast_in_dim(v, (TILE, ROWS), [1])
  channels = lambda v: lax.broadcast_in_dim(v, (TILE, ROWS), [0])
  gmem_chunk = lambda ref, c0: _load(ref.at[pl.ds(c0, TILE), :], WGMMA)
  vector = lambda ref: channels(_load(ref, WGMMA.reduce(1)))   # a [64] ref along the channels
  tile = lambda smem: _load(smem, WGMMA, optimized=True)
  k_tile = lambda j, base=0: pl.ds(base + k0 + j * TILE, TILE)

  def barrier(k):   # the k-th grid-wide barrier of this call (k from 0)
    plgpu.semaphore_signal(sem, 1, memory_scope='gpu')
    pl.semaphore_wait(sem, n_ctas * (k + 1), decrement=False)

  def fetch_weights(w_ref, i, slot):
    """This CTA's [ks, 64] slice of w_ref[i] into weight slot `slot`, tile j arriving on its barrier."""
    for j in range(tiles):
      plgpu.copy_gmem_to_smem(w_ref.at[i, k_tile(j), pl.ds(n0, TILE)], w_smem.at[slot, j],
                              w_bars.at[slot * tiles + j])

  def gemm(slot, out_ref, operand):
    """out_ref[s, n0:n0 + 64] = (weight slot)^T @ B, B's tile j = operand(j) [64, 16] (in float32),
    each tile's wgmma issued once its operand is stored and its weights have landed."""
    @functools.partial(pl.run_scoped, acc=plgpu.ACC((TILE, ROWS), jnp.float32))
    def _(acc):
      for j in range(tiles):
        xm_smem.at[j][...] = operand(j).astype(xm_smem.dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(w_bars.at[slot * tiles + j])
        plgpu.wgmma(acc, plgpu.transpose_ref(w_smem.at[slot, j], (1, 0)), xm_smem.at[j])
      plgpu.wgmma_wait(0)
      out_ref.at[s, pl.ds(n0, TILE), :][...] = acc[...]

  def prefetch(w_ref, i, slot):
    """Block i + 1's weights into `slot` once block i is done with it; in a loop, the last block
    copies its own again (waited for at the end), so that no copy depends on a condition."""
    if isinstance(i, int):
      if i + 1 < count:
        fetch_weights(w_ref, first + i + 1, slot)
    else:
      fetch_weights(w_ref, first + jnp.minimum(i + 1, count - 1), slot)

  def owner_writes(x):
    """Column block n's rows x [64, 16] into the state, with their mean and M2 over its channels."""
    x_ref.at[pl.ds(n0, TILE), :][...] = x
    m = jnp.sum(x, axis=0) / TILE
    d = x - rows(m)
    stats_ref.at[n, 0][...] = rows(m)
    stats_ref.at[n, 1][...] = rows(jnp.sum(d * d, axis=0))

  def statistics():
    """Every row's mean and 1 / std, merged from the column blocks' means and M2 (Chan et al.)."""
    means = [_load(stats_ref.at[j, 0, 0], WGMMA.reduce(0)) for j in range(nt)]
    m2s = [_load(stats_ref.at[j, 1, 0], WGMMA.reduce(0)) for j in range(nt)]
    mean = sum(means[1:], means[0]) / nt
    m2 = sum(m2s[1:], m2s[0]) + TILE * sum((m - mean) * (m - mean) for m in means)
    return rows(mean), rows(lax.rsqrt(m2 / c + eps))

  fetch_weights(w1_ref, first, 0)
  fetch_weights(w2_ref, first, 1)

  @pl.when(s == 0)
  def _():
    owner_writes(gmem_chunk(x0_ref, n0))
  barrier(0)

  def block(i, carry):   # block first + i of the stacks
    b = first + i
    mods = mods_ref.at[pl.ds(b * 3 * c, 3 * c)]

    # A: fc1's partial sums of this K-slice of LN(x) * (1 + scale).
    @functools.partial(pl.run_scoped, xa=plgpu.SMEM((tiles, TILE, ROWS), jnp.float32, transforms=_tiled(4)),
                       scale=plgpu.SMEM((tiles, TILE, ROWS), mods_ref.dtype, transforms=_tiled()))
    def _(xa, scale):
      for j in range(tiles):
        plgpu.copy_gmem_to_smem(x_ref.at[k_tile(j), :], xa.at[j], a_bars.at[j])
        plgpu.copy_gmem_to_smem(mods.at[k_tile(j, c)], scale.at[j], a_bars.at[j])
      mean, rstd = statistics()

      def modulated(j):
        g, be = vector(g_ref.at[b, k_tile(j)]), vector(be_ref.at[b, k_tile(j)])
        plgpu.barrier_wait(a_bars.at[j])
        h = (tile(xa.at[j]) - mean) * rstd * g + be
        return h * (1.0 + tile(scale.at[j]).astype(jnp.float32))

      gemm(0, p1_ref, modulated)

    prefetch(w1_ref, i, 0)
    barrier(3 * i + 1)

    # B: fc2's partial sums of this K-slice of SiLU(fc1's output).
    @functools.partial(pl.run_scoped,
                       ps=plgpu.SMEM((tiles, splits, TILE, ROWS), jnp.float32, transforms=_tiled(4)),
                       shift=plgpu.SMEM((tiles, TILE, ROWS), mods_ref.dtype, transforms=_tiled()))
    def _(ps, shift):
      for j in range(tiles):
        plgpu.copy_gmem_to_smem(p1_ref.at[:, k_tile(j)], ps.at[j], b_bars.at[j])
        plgpu.copy_gmem_to_smem(mods.at[k_tile(j)], shift.at[j], b_bars.at[j])

      def activated(j):
        h = vector(b1_ref.at[b, k_tile(j)])
        plgpu.barrier_wait(b_bars.at[j])
        h = h + tile(shift.at[j]).astype(jnp.float32)
        for t in range(splits):
          h = h + tile(ps.at[j, t])
        return h / (1.0 + jnp.exp(-h))

      gemm(1, p2_ref, activated)

    prefetch(w2_ref, i, 1)
    barrier(3 * i + 2)

    # C: the residual, by one CTA per 64 channels.
    @pl.when(s == 0)
    def _():
      parts = [gmem_chunk(p2_ref.at[t], n0) for t in range(splits)]
      x, gate = gmem_chunk(x_ref, n0), gmem_chunk(mods, 2 * c + n0).astype(jnp.float32)
      y = sum(parts[1:], parts[0]) + vector(b2_ref.at[b, pl.ds(n0, TILE)])
      owner_writes(x + gate * y)
    barrier(3 * i + 3)
    return carry

  if unroll:
    for i in range(count):
      block(i, None)
  else:
    lax.fori_loop(0, count, block, None)
    for j in range(2 * tiles):   # the last block's copies of the last weights again
      plgpu.barrier_wait(w_bars.at[j])
  # One arrival more than the last barrier needs: CTA 0 returns the count to 0 only after every
  # CTA has left that barrier's wait.
  plgpu.semaphore_signal(sem, 1, memory_scope='gpu')

  @pl.when(cta == 0)
  def _():
    pl.semaphore_wait(sem, n_ctas * (3 * count + 2))


def device_sms() -> int:
  """SMs of the default device if it is a Hopper GPU, else 0 (wgmma is Hopper's)."""
  return jax.devices()[0].core_count if dispatch.is_hopper() else 0


@functools.partial(jax.jit, static_argnames=('eps', 'num_sms', 'unroll', 'blocks_per_call'))
def diffloss_blocks(x: jax.Array, mods: jax.Array, w1: jax.Array, b1: jax.Array, w2: jax.Array,
                    b2: jax.Array, ln_scale: jax.Array, ln_bias: jax.Array, *, eps: float = 1e-6,
                    num_sms: int | None = None, unroll: bool = False,
                    blocks_per_call: int | None = None) -> jax.Array:
  """The D res blocks of a DiffLoss step on rows x [R, C] -> [R, C] in x's dtype.

  mods [R, >= 3 D C]: each block's adaLN outputs (shift_w, scale, gate), block after block (the
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
  per_call = blocks_per_call or depth
  if depth % per_call:
    raise ValueError(f'blocks_per_call {per_call} does not divide the {depth} blocks')
  splits = splits_for(c, num_sms)
  tiles = c // splits // TILE
  transposed = lambda a, dtype: jnp.pad(a.astype(dtype).T, ((0, 0), (0, ROWS - r)))
  f32 = lambda a: a.astype(jnp.float32)
  partial_sums = jax.ShapeDtypeStruct((splits, c, ROWS), jnp.float32)
  call = plgpu.kernel(
      functools.partial(_kernel, splits=splits, eps=eps, count=per_call, unroll=unroll),
      out_type=(jax.ShapeDtypeStruct((c, ROWS), jnp.float32), partial_sums, partial_sums,
                jax.ShapeDtypeStruct((c // TILE, 2, TILE, ROWS), jnp.float32)),
      scratch_types=[plgpu.SMEM((2, tiles, TILE, TILE), w1.dtype, transforms=_tiled()),
                     plgpu.SMEM((tiles, TILE, ROWS), w1.dtype, transforms=_tiled()),
                     plgpu.Barrier(num_barriers=2 * tiles),
                     plgpu.Barrier(num_arrivals=2, num_barriers=tiles),
                     plgpu.Barrier(num_arrivals=2, num_barriers=tiles)],
      grid=(c // TILE * splits,), grid_names=('cta',),
      # Lane semantics, which the kernel is written in (jax >= 0.11 defaults to Warpgroup's).
      compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
  )
  state, mods_t = transposed(x, jnp.float32), transposed(mods[:, :3 * depth * c], w1.dtype)
  weights = (w1, f32(b1), w2.astype(w1.dtype), f32(b2), f32(ln_scale), f32(ln_bias))
  for start in range(0, depth, per_call):
    state = call(jnp.full((1,), start, jnp.int32), state, mods_t, *weights)[0]
  return state[:, :r].T.astype(x.dtype)
