"""Block-sparse flash attention forward for Hopper, in Pallas' Mosaic GPU lowering.

The same computation as the Triton forward of `sparse_attention` (the layout's
lists, full tiles first, partial tiles with their token mask, online softmax in
base 2), organised the FlashAttention-3 way: one CTA per (query block, head,
batch) with three warpgroups. Warpgroup 2 streams the active key and value tiles
through a ring of STAGES shared-memory slots with TMA; warpgroups 0 and 1 each
own half of the query block (64 rows) and run wgmma on it. A shared "turn"
barrier staggers the two by half a step, so one's softmax overlaps the other's
matmuls. Both halves walk the same list (the layout is per query block), so the
ring is consumed in lock step.

TMA reads past Lq or Lk come back as zeros and its writes past Lq are dropped:
lengths need not be block multiples (the key-tail tile is partial, so masked).
Partial tiles add their mask as a 0 / -inf bias read from global memory; they
are few (2 of 355 in SparVAR's Table 1 layout).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.layout import BlockLayout

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
HALF = 64  # query rows per compute warpgroup: wgmma's M tile
STAGES = 2  # key/value ring slots: two measured faster than three (NOTES.md)


@dataclasses.dataclass(frozen=True)
class _Dims:
  block_k: int
  head_dim: int
  per_head: bool
  qk_scale: float  # softmax scale x log2(e)
  dtype: jnp.dtype
  with_lse: bool


def unsupported(q: jax.Array, k: jax.Array, layout: BlockLayout) -> str:
  """Why this kernel does not take these arguments ('' when it does)."""
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f'the Mosaic GPU forward takes bfloat16 or float16, got {q.dtype}'
  if q.shape[-1] not in (64, 128):
    return f'the Mosaic GPU forward takes head dim 64 or 128, got {q.shape[-1]}'
  if layout.block_q != 2 * HALF or layout.block_k not in (64, 128):
    return (f'the Mosaic GPU forward takes layouts of block_q {2 * HALF} and block_k 64 or 128, '
            f'got {layout.block_q} x {layout.block_k}')
  if q.shape[1] % 8 or k.shape[1] % 8:
    return (f'the Mosaic GPU forward takes q and k lengths that are multiples of 8 (TMA), got '
            f'{q.shape[1]} and {k.shape[1]}')
  return ''


def _kernel(ids_ref, nfull_ref, count_ref, mids_ref, bias_ref, q_ref, k_ref, v_ref, o_ref, *rest, d: _Dims):
  lse_ref, scoped = rest if d.with_lse else (None, rest[0])
  (q_smem2, k_smem, v_smem, lse_smem2), (k_ready, v_ready, q_ready), (k_free, v_free), turn = scoped
  u, head, batch = lax.axis_index('q_blk'), lax.axis_index('heads'), lax.axis_index('batch')
  wg = lax.axis_index('wg')
  hl = head if d.per_head else 0
  count = count_ref[hl, u]

  def pass_turn():
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  @pl.when(wg < 2)
  def _compute():
    plgpu.set_max_registers(232, action='increase')
    q_smem = q_smem2.at[wg]
    q0 = u * (2 * HALF) + wg * HALF
    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q0, HALF), head], q_smem, q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])

    def step(t, carry, masked: bool):
      acc, m, l = carry
      slot = lax.rem(t, STAGES)

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        pass_turn()
        return acc_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((HALF, d.block_k), jnp.float32))
      plgpu.barrier_arrive(k_free.at[slot])
      s = s * d.qk_scale
      if masked:
        rows = bias_ref.at[mids_ref[hl, u, t], pl.ds(wg * HALF, HALF)]
        s = s + plgpu.load(rows, layout=plgpu.Layout.WGMMA, optimized=False)
      m_new = jnp.maximum(m, s.max(axis=1))
      # A row with no visible key yet keeps m = -inf: exponentiate against 0 then.
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
      alpha = jnp.exp2(m - m_use)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      l = l * alpha + p.sum(axis=1)
      p16 = p.astype(d.dtype)
      # Keeps the softmax ahead of the turn hand-over below (FlashAttention-3's ordering).
      acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_wait(turn)

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
        nxt = t + 1

        @pl.when(nxt < count)
        def _():
          plgpu.barrier_wait(k_ready.at[lax.rem(nxt, STAGES)])
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    carry = (plgpu.layout_cast(jnp.zeros((HALF, d.head_dim), jnp.float32), plgpu.Layout.WGMMA),
             plgpu.layout_cast(jnp.full((HALF,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
             plgpu.layout_cast(jnp.zeros((HALF,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))

    @pl.when(count > 0)
    def _():
      plgpu.barrier_wait(k_ready.at[0])
    pl.when(wg == 1)(pass_turn)  # warpgroup 1 runs half a step behind warpgroup 0
    n_full = nfull_ref[hl, u]
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(n_full, count, functools.partial(step, masked=True), carry)
    pl.when(wg == 0)(pass_turn)

    l_safe = jnp.where(l == 0.0, 1.0, l)  # rows that saw no key: out 0, lse -inf
    q_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(d.dtype)
    if d.with_lse:
      lse_smem2.at[wg][...] = m * LN2 + jnp.log(l_safe)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[batch, pl.ds(q0, HALF), head])
    if d.with_lse:
      plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[batch, head, pl.ds(q0, HALF)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _memory():
    plgpu.set_max_registers(40, action='decrease')

    def fetch(t, slot, ref, smem, ready):
      rows = (batch, pl.ds(ids_ref[hl, u, t] * d.block_k, d.block_k), head)
      plgpu.copy_gmem_to_smem(ref.at[rows], smem.at[slot], ready.at[slot])

    for t in range(STAGES):
      @pl.when(t < count)
      def _():
        fetch(t, t, k_ref, k_smem, k_ready)
        fetch(t, t, v_ref, v_smem, v_ready)

    @pl.loop(0, jnp.maximum(count - STAGES, 0))
    def _(i):
      slot = lax.rem(i, STAGES)
      plgpu.barrier_wait(k_free.at[slot])
      fetch(i + STAGES, slot, k_ref, k_smem, k_ready)
      plgpu.barrier_wait(v_free.at[slot])
      fetch(i + STAGES, slot, v_ref, v_smem, v_ready)


def forward(q, k, v, layout: BlockLayout, scale: float, *, with_lse: bool = True):
  """q [B, Lq, H, D], k and v [B, Lk, H, D] -> out [B, Lq, H, D] and, `with_lse`, lse
  [B, H, Lq] float32 (natural log; -inf on rows that see no key, whose output is 0).

  `unsupported` says which arguments run here (Lq and Lk multiples of 8: TMA tiles
  rows in eights).
  """
  b, lq, h, hd = q.shape
  d = _Dims(block_k=layout.block_k, head_dim=hd, per_head=layout.heads > 1, qk_scale=scale * LOG2E,
            dtype=q.dtype, with_lse=with_lse)
  lists = [jnp.asarray(a) for a in (layout.kv_ids, layout.kv_full, layout.kv_count, layout.kv_mask)]
  bias = jnp.where(jnp.asarray(layout.masks) != 0, 0.0, -jnp.inf).astype(jnp.float32)
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  out_type = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if with_lse:  # rows padded to whole query blocks: TMA needs 16-byte row strides
    out_type.append(jax.ShapeDtypeStruct((b, h, layout.num_q_blocks * layout.block_q), jnp.float32))

  def entry(*refs):
    scratch = [plgpu.SMEM((2, HALF, hd), q.dtype, transforms=tiled),
               plgpu.SMEM((STAGES, d.block_k, hd), q.dtype, transforms=tiled),
               plgpu.SMEM((STAGES, d.block_k, hd), q.dtype, transforms=tiled),
               plgpu.SMEM((2, HALF), jnp.float32) if with_lse else None]
    pl.run_scoped(
        lambda *scoped: _kernel(*refs, scoped, d=d), scratch,
        (plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=STAGES),
         plgpu.Barrier(num_barriers=2)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),) * 2,
        plgpu.Barrier(num_arrivals=2),
        collective_axes='wg')

  outs = plgpu.kernel(
      entry, out_type=out_type,
      grid=(layout.num_q_blocks, h, b),
      grid_names=('q_blk', 'heads', 'batch'),
      num_threads=3,
      thread_name='wg',
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*lists, bias, q, k, v)
  return (outs[0], outs[1][..., :lq]) if with_lse else outs[0]
