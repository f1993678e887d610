"""Block-sparse flash attention for Hopper in Pallas' Mosaic GPU lowering, forward and backward.

The same computation as the Triton kernels of `sparse_attention` (the layout's
lists, full tiles first, partial tiles with their token mask, softmax in base
2), organised the FlashAttention-3 way: one CTA per block with three
warpgroups. The last streams tiles through a ring of shared-memory slots
with TMA; the others each own 64 rows of the CTA's block (wgmma's M tile) and
run wgmma on them. Both compute warpgroups walk the same list, so the ring is
consumed in lock step.

Forward: one CTA per (query block, head, batch) over the forward lists; the
producer streams key and value tiles. A shared "turn" barrier staggers the two
compute warpgroups by half a step, so one's softmax overlaps the other's
matmuls.

Backward (FlashAttention-2's split): dK/dV with one CTA per (key block, head,
batch) over the transposed lists, the producer streaming each listed query
block as two 64-row steps of q, dO, lse and delta; dQ with one CTA per (query
block, head, batch) over the forward lists, the producer streaming key and
value tiles in 64-row steps. 64-row steps keep dK/dV's two [64, D] float32
accumulators and the step's [64, 64] scores in registers at D 128.

Every kernel starts its CTAs longest list first, so short ones fill the last
wave. TMA reads past Lq or Lk come back as zeros and its writes past them are
dropped: lengths need not be block multiples (the key-tail tile is partial, so
masked). Partial tiles add their mask as a 0 / -inf bias read from global
memory; they are few (2 of 355 in SparVAR's Table 1 layout).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu_api
from pallas_kernels.layout import BlockLayout

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
ROWS = 64  # wgmma's M tile: a compute warpgroup's rows, and the backward's step
STAGES = 2  # the forward's ring slots: two measured faster than three (NOTES.md)
BWD_STAGES = 2  # the backward's: three measured no faster, within one run's spread (NOTES.md)
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class _Dims:
  block_q: int
  block_k: int
  head_dim: int
  per_head: bool
  scale: float
  dtype: jnp.dtype
  stages: int

  @property
  def qk_scale(self) -> float:  # the softmax scale in base 2
    return self.scale * LOG2E


def _dims(q, layout: BlockLayout, scale: float, stages: int) -> _Dims:
  return _Dims(block_q=layout.block_q, block_k=layout.block_k, head_dim=q.shape[-1],
               per_head=layout.heads > 1, scale=scale, dtype=q.dtype, stages=stages)


def unsupported(q: jax.Array, k: jax.Array, layout: BlockLayout) -> str:
  """Why these kernels do not take these arguments ('' when they do)."""
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f'the Mosaic GPU kernels take bfloat16 or float16, got {q.dtype}'
  if q.shape[-1] not in (64, 128):
    return f'the Mosaic GPU kernels take head dim 64 or 128, got {q.shape[-1]}'
  if layout.block_q != 2 * ROWS or layout.block_k not in (ROWS, 2 * ROWS):
    return (f'the Mosaic GPU kernels take layouts of block_q {2 * ROWS} and block_k {ROWS} or '
            f'{2 * ROWS}, got {layout.block_q} x {layout.block_k}')
  return ''


def _check_rows(q, k) -> None:
  if q.shape[1] % 8 or k.shape[1] % 8:
    raise ValueError(f'the Mosaic GPU kernels take q and k lengths that are multiples of 8 (TMA), '
                     f'got {q.shape[1]} and {k.shape[1]}')


def _zeros(shape):
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _bias(masks: np.ndarray) -> jax.Array:
  """int8 token masks [P, R, C] -> float32 [P, R, C], 0 where attended and -inf elsewhere."""
  return jnp.where(jnp.asarray(masks) != 0, 0.0, -jnp.inf).astype(jnp.float32)


def _stream(steps, fetches, stages: int):
  """The producer warpgroup: with few registers, for each step i < steps and each (fetch,
  free) pair, fetch(i, slot) into ring slot i % stages once the consumers have arrived on
  free[slot] for what the slot held before."""
  plgpu.set_max_registers(40, action='decrease')
  for i in range(stages):
    @pl.when(i < steps)
    def _():
      for fetch, _ in fetches:
        fetch(i, i)

  @pl.loop(0, jnp.maximum(steps - stages, 0))
  def _(i):
    slot = lax.rem(i, stages)
    for fetch, free in fetches:
      plgpu.barrier_wait(free.at[slot])
      fetch(i + stages, slot)


def _call(body, lists, bias, args, *, out_type, grid, grid_names, compute_wgs, scratch, barriers):
  """`body(*lists, bias, *args, *outs, scoped)` on `grid`, compute_wgs + 1 warpgroups
  sharing the scratch buffers and barriers `scoped`."""
  def entry(*refs):
    pl.run_scoped(lambda *scoped: body(*refs, scoped), scratch, *barriers, collective_axes='wg')

  return plgpu.kernel(
      entry, out_type=out_type, grid=grid, grid_names=grid_names,
      num_threads=compute_wgs + 1, thread_name='wg',
      compiler_params=mosaic_gpu_api.compiler_params(approx_math=True),
  )(*[jnp.asarray(a) for a in lists], bias, *args)


def _sub_step(i, subs: int):
  """Backward step i -> (its entry in the block's list, its first row in that listed block):
  each listed block is walked in `subs` steps of ROWS rows."""
  return lax.div(i, subs), lax.rem(i, subs) * ROWS


def _with_bias(s, bias_ref, mid, wg, col0):
  """s [ROWS, ROWS] plus the 0 / -inf bias of mask-table row `mid`: this warpgroup's rows,
  the step's columns col0 .. col0 + ROWS."""
  tile = bias_ref.at[mid, pl.ds(wg * ROWS, ROWS), pl.ds(col0, ROWS)]
  return s + mosaic_gpu_api.load(tile, layout=plgpu.Layout.WGMMA, optimized=False)


def _copy_query_rows(srcs, dsts, batch, head, q0, barrier) -> None:
  """Copies rows q0.. (ROWS of them) of q, dO [B, L, H, D] and lse2, delta [B, H, L]
  (`srcs`, in that order) into `dsts`, each copy arriving on `barrier`."""
  q_ref, do_ref, lse_ref, delta_ref = srcs
  q_dst, do_dst, lse_dst, delta_dst = dsts
  rows = (batch, pl.ds(q0, ROWS), head)
  plgpu.copy_gmem_to_smem(q_ref.at[rows], q_dst, barrier)
  plgpu.copy_gmem_to_smem(do_ref.at[rows], do_dst, barrier)
  for ref, dst in ((lse_ref, lse_dst), (delta_ref, delta_dst)):
    plgpu.copy_gmem_to_smem(ref.at[batch, head, pl.ds(q0, ROWS)], dst, barrier)


def _longest_first(count: np.ndarray) -> np.ndarray:
  """[Hl, n] block order by descending list length: the long CTAs start in the first
  waves and the short ones fill the last."""
  return np.argsort(-count, axis=1, kind='stable').astype(np.int32)


# ----------------------------------------------------------------------- forward
def _fwd_kernel(order_ref, ids_ref, nfull_ref, count_ref, mids_ref, bias_ref, q_ref, k_ref, v_ref,
                o_ref, *rest, d: _Dims, with_lse: bool):
  lse_ref, scoped = rest if with_lse else (None, rest[0])
  (q_smem2, k_smem, v_smem, lse_smem2), (k_ready, v_ready, q_ready), (k_free, v_free), turn = scoped
  head, batch = lax.axis_index('heads'), lax.axis_index('batch')
  wg = lax.axis_index('wg')
  hl = head if d.per_head else 0
  u = order_ref[hl, lax.axis_index('q_blk')]
  count = count_ref[hl, u]

  def pass_turn():
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  @pl.when(wg < 2)
  def _compute():
    plgpu.set_max_registers(232, action='increase')
    q_smem = q_smem2.at[wg]
    q0 = u * d.block_q + wg * ROWS
    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q0, ROWS), head], q_smem, q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])

    def step(t, carry, masked: bool):
      acc, m, l = carry
      slot = lax.rem(t, d.stages)

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        pass_turn()
        return acc_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((ROWS, d.block_k), jnp.float32))
      plgpu.barrier_arrive(k_free.at[slot])
      s = s * d.qk_scale
      if masked:
        rows = bias_ref.at[mids_ref[hl, u, t], pl.ds(wg * ROWS, ROWS)]
        s = s + mosaic_gpu_api.load(rows, layout=plgpu.Layout.WGMMA, optimized=False)
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
          plgpu.barrier_wait(k_ready.at[lax.rem(nxt, d.stages)])
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    carry = (_zeros((ROWS, d.head_dim)),
             plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
             plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))

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
    if with_lse:
      lse_smem2.at[wg][...] = m * LN2 + jnp.log(l_safe)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[batch, pl.ds(q0, ROWS), head])
    if with_lse:
      plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[batch, head, pl.ds(q0, ROWS)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _memory():
    def fetch(t, slot, ref, smem, ready):
      rows = (batch, pl.ds(ids_ref[hl, u, t] * d.block_k, d.block_k), head)
      plgpu.copy_gmem_to_smem(ref.at[rows], smem.at[slot], ready.at[slot])

    _stream(count, [(functools.partial(fetch, ref=k_ref, smem=k_smem, ready=k_ready), k_free),
                    (functools.partial(fetch, ref=v_ref, smem=v_smem, ready=v_ready), v_free)],
            d.stages)


def forward(q, k, v, layout: BlockLayout, scale: float, *, with_lse: bool = True):
  """q [B, Lq, H, D], k and v [B, Lk, H, D] -> out [B, Lq, H, D] and, `with_lse`, lse
  [B, H, Lq] float32 (natural log; -inf on rows that see no key, whose output is 0).

  Lq and Lk must be multiples of 8 (TMA moves rows in eights; `block_sparse_attention`
  pads for it); `unsupported` says which other arguments run here.
  """
  _check_rows(q, k)
  b, lq, h, hd = q.shape
  d = _dims(q, layout, scale, STAGES)
  out_type = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if with_lse:  # rows padded to whole query blocks: TMA needs 16-byte row strides
    out_type.append(jax.ShapeDtypeStruct((b, h, layout.num_q_blocks * layout.block_q), jnp.float32))
  outs = _call(
      functools.partial(_fwd_kernel, d=d, with_lse=with_lse),
      (_longest_first(layout.kv_count), layout.kv_ids, layout.kv_full, layout.kv_count,
       layout.kv_mask), _bias(layout.masks), (q, k, v),
      out_type=out_type, grid=(layout.num_q_blocks, h, b), grid_names=('q_blk', 'heads', 'batch'),
      compute_wgs=2,
      scratch=[plgpu.SMEM((2, ROWS, hd), q.dtype, transforms=TILED),
               plgpu.SMEM((d.stages, d.block_k, hd), q.dtype, transforms=TILED),
               plgpu.SMEM((d.stages, d.block_k, hd), q.dtype, transforms=TILED),
               plgpu.SMEM((2, ROWS), jnp.float32) if with_lse else None],
      barriers=[(plgpu.Barrier(num_barriers=d.stages), plgpu.Barrier(num_barriers=d.stages),
                 plgpu.Barrier(num_barriers=2)),
                (plgpu.Barrier(num_arrivals=2, num_barriers=d.stages),) * 2,
                plgpu.Barrier(num_arrivals=2)])
  return (outs[0], outs[1][..., :lq]) if with_lse else outs[0]


# ---------------------------------------------------------------------- backward
def _dkv_kernel(order_ref, ids_ref, nfull_ref, count_ref, mids_ref, bias_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, dk_ref, dv_ref, scoped, *, d: _Dims):
  (k_smem2, v_smem2, q_ring, do_ring, lse_ring, delta_ring), (kv_ready, ready), free = scoped
  head, batch = lax.axis_index('heads'), lax.axis_index('batch')
  wg = lax.axis_index('wg')
  hl = head if d.per_head else 0
  j = order_ref[hl, lax.axis_index('k_blk')]
  compute_wgs, subs = d.block_k // ROWS, d.block_q // ROWS
  steps = count_ref[hl, j] * subs  # step i: rows (i % subs) * 64.. of listed query block i // subs

  @pl.when(wg < compute_wgs)
  def _compute():
    plgpu.set_max_registers(232, action='increase')
    k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
    rows = (batch, pl.ds(j * d.block_k + wg * ROWS, ROWS), head)
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, kv_ready.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, kv_ready.at[wg])
    plgpu.barrier_wait(kv_ready.at[wg])

    def step(i, carry, masked: bool):
      dk, dv = carry
      slot = lax.rem(i, d.stages)
      q_smem, do_smem = q_ring.at[slot], do_ring.at[slot]
      plgpu.barrier_wait(ready.at[slot])

      def kq(acc_ref):
        plgpu.wgmma(acc_ref, k_smem, plgpu.transpose_ref(q_smem, (1, 0)))
        return acc_ref[...]
      s_t = pl.run_scoped(kq, plgpu.ACC((ROWS, ROWS), jnp.float32)) * d.qk_scale  # [keys, queries]
      if masked:
        t, r0 = _sub_step(i, subs)
        s_t = _with_bias(s_t, bias_ref, mids_ref[hl, j, t], wg, r0)
      lse2 = mosaic_gpu_api.load(lse_ring.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      p_t = jnp.exp2(s_t - lax.broadcast_in_dim(lse2, s_t.shape, [1]))

      def dv_and_dp(refs):  # two matmuls, one wait
        dv_ref, dp_ref = refs
        plgpu.wgmma(dv_ref, p_t.astype(d.dtype), do_smem)
        plgpu.wgmma(dp_ref, v_smem, plgpu.transpose_ref(do_smem, (1, 0)))
      dv, dp_t = pl.run_state(dv_and_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(_zeros(s_t.shape))))
      delta = mosaic_gpu_api.load(delta_ring.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))

      def dk_step(acc_ref):
        plgpu.wgmma(acc_ref, ds_t.astype(d.dtype), q_smem)
      dk = pl.run_state(dk_step)(plgpu.ACC.init(dk))
      plgpu.barrier_arrive(free.at[slot])
      return dk, dv

    n_full = nfull_ref[hl, j] * subs
    zeros = _zeros((ROWS, d.head_dim))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), (zeros, zeros))
    dk, dv = lax.fori_loop(n_full, steps, functools.partial(step, masked=True), carry)
    k_smem[...] = (dk * d.scale).astype(d.dtype)
    v_smem[...] = dv.astype(d.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == compute_wgs)
  def _memory():
    def fetch(i, slot):
      t, r0 = _sub_step(i, subs)
      q0 = ids_ref[hl, j, t] * d.block_q + r0
      _copy_query_rows((q_ref, do_ref, lse_ref, delta_ref),
                       (q_ring.at[slot], do_ring.at[slot], lse_ring.at[slot], delta_ring.at[slot]),
                       batch, head, q0, ready.at[slot])

    _stream(steps, [(fetch, free)], d.stages)


def _dq_kernel(order_ref, ids_ref, nfull_ref, count_ref, mids_ref, bias_ref, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, dq_ref, scoped, *, d: _Dims):
  (q_smem2, do_smem2, lse_smem2, delta_smem2, k_ring, v_ring), (q_ready, ready), free = scoped
  head, batch = lax.axis_index('heads'), lax.axis_index('batch')
  wg = lax.axis_index('wg')
  hl = head if d.per_head else 0
  u = order_ref[hl, lax.axis_index('q_blk')]
  subs = d.block_k // ROWS
  steps = count_ref[hl, u] * subs  # step i: rows (i % subs) * 64.. of listed key block i // subs

  @pl.when(wg < 2)
  def _compute():
    plgpu.set_max_registers(232, action='increase')
    q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
    q0 = u * d.block_q + wg * ROWS
    _copy_query_rows((q_ref, do_ref, lse_ref, delta_ref),
                     (q_smem, do_smem, lse_smem2.at[wg], delta_smem2.at[wg]), batch, head, q0,
                     q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])
    lse2 = mosaic_gpu_api.load(lse_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
    delta = mosaic_gpu_api.load(delta_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))

    def step(i, dq, masked: bool):
      slot = lax.rem(i, d.stages)
      k_smem, v_smem = k_ring.at[slot], v_ring.at[slot]
      plgpu.barrier_wait(ready.at[slot])

      def s_and_dp(refs):  # two matmuls, one wait
        s_ref, dp_ref = refs
        plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
        plgpu.wgmma(dp_ref, do_smem, plgpu.transpose_ref(v_smem, (1, 0)))
      zeros = _zeros((ROWS, ROWS))
      s, dp = pl.run_state(s_and_dp)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
      s = s * d.qk_scale
      if masked:
        t, r0 = _sub_step(i, subs)
        s = _with_bias(s, bias_ref, mids_ref[hl, u, t], wg, r0)
      p = jnp.exp2(s - lax.broadcast_in_dim(lse2, s.shape, [0]))
      ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))

      def dq_step(acc_ref):
        plgpu.wgmma(acc_ref, ds.astype(d.dtype), k_smem)
      dq = pl.run_state(dq_step)(plgpu.ACC.init(dq))
      plgpu.barrier_arrive(free.at[slot])
      return dq

    n_full = nfull_ref[hl, u] * subs
    dq = lax.fori_loop(0, n_full, functools.partial(step, masked=False), _zeros((ROWS, d.head_dim)))
    dq = lax.fori_loop(n_full, steps, functools.partial(step, masked=True), dq)
    q_smem[...] = (dq * d.scale).astype(d.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[batch, pl.ds(q0, ROWS), head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _memory():
    def fetch(i, slot):
      t, r0 = _sub_step(i, subs)
      k0 = ids_ref[hl, u, t] * d.block_k + r0
      rows = (batch, pl.ds(k0, ROWS), head)
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_ring.at[slot], ready.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_ring.at[slot], ready.at[slot])

    _stream(steps, [(fetch, free)], d.stages)


def backward(q, k, v, do, lse2, delta, layout: BlockLayout, scale: float):
  """Gradients (dq, dk, dv) of `forward`'s output, given its cotangent do [B, Lq, H, D].

  lse2 [B, H, Lq] float32: the forward's lse in base 2, +inf on rows that see no key;
  delta [B, H, Lq] float32: rowsum(dO * O) minus lse's own cotangent. Keys past
  layout.lk (k, v may run up to its last key block) get zero gradient.
  """
  _check_rows(q, k)
  b, lq, h, hd = q.shape
  d = _dims(q, layout, scale, BWD_STAGES)
  # Whole query blocks (TMA's 16-byte rows): steps past Lq read lse2 +inf, so p = 0.
  pad = ((0, 0), (0, 0), (0, layout.num_q_blocks * layout.block_q - lq))
  args = (q, k, v, do, jnp.pad(lse2, pad, constant_values=jnp.inf), jnp.pad(delta, pad))
  compute_wgs = layout.block_k // ROWS
  tile_smem = lambda n: plgpu.SMEM((n, ROWS, hd), q.dtype, transforms=TILED)
  row_smem = lambda n: plgpu.SMEM((n, ROWS), jnp.float32)
  # Ready barriers take one arrival per TMA copy; free barriers one per compute warpgroup.
  dk, dv = _call(
      functools.partial(_dkv_kernel, d=d),
      (_longest_first(layout.q_count), layout.q_ids, layout.q_full, layout.q_count, layout.q_mask),
      _bias(layout.masks.transpose(0, 2, 1)), args,
      out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      grid=(layout.num_k_blocks, h, b), grid_names=('k_blk', 'heads', 'batch'),
      compute_wgs=compute_wgs,
      scratch=[tile_smem(compute_wgs), tile_smem(compute_wgs), tile_smem(d.stages),
               tile_smem(d.stages), row_smem(d.stages), row_smem(d.stages)],
      barriers=[(plgpu.Barrier(num_arrivals=2, num_barriers=compute_wgs),
                 plgpu.Barrier(num_arrivals=4, num_barriers=d.stages)),
                plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=d.stages)])
  dq = _call(
      functools.partial(_dq_kernel, d=d),
      (_longest_first(layout.kv_count), layout.kv_ids, layout.kv_full, layout.kv_count,
       layout.kv_mask),
      _bias(layout.masks), args,
      out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(layout.num_q_blocks, h, b), grid_names=('q_blk', 'heads', 'batch'), compute_wgs=2,
      scratch=[tile_smem(2), tile_smem(2), row_smem(2), row_smem(2), tile_smem(d.stages),
               tile_smem(d.stages)],
      barriers=[(plgpu.Barrier(num_arrivals=4, num_barriers=2),
                 plgpu.Barrier(num_arrivals=2, num_barriers=d.stages)),
                plgpu.Barrier(num_arrivals=2, num_barriers=d.stages)])
  return dq, dk, dv
