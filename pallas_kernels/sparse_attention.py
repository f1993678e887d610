"""Block-sparse flash attention in Pallas (Triton lowering), forward and backward.

One program per (query block, batch, head) walks its active key blocks from
the layout's lists -- full tiles first with no masking, then partial tiles with
their token mask -- with an online softmax in base 2. The backward pass is two
kernels (FlashAttention-2 style): dK/dV per key sub-block over the transposed
lists, dQ per query sub-block over the forward lists; sub-blocks keep the
backward's accumulators in registers at the layout's (larger) tile size.
Lengths need not be block multiples: loads and stores past Lq or Lk are masked.
On Hopper, `sparse_attention_mgpu` runs both directions instead where it can.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch, reference, sparse_attention_mgpu
from pallas_kernels.layout import BlockLayout

LOG2E = math.log2(math.e)
BWD_STAGES = 2  # the backward's pipeline depth, as measured (NOTES.md)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The widest head a tile takes: a [128, D] query tile's accumulator stays in registers and its
# key/value stages in shared memory (an A100's 164 KB); a VAE's 512-wide head asked an H200
# for 656 KiB.
MAX_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  interpret: bool
  bwd_block_q: int
  bwd_block_k: int
  num_warps: int
  bwd_num_warps: int
  num_stages: int
  mosaic: bool  # both directions in Mosaic GPU (Hopper); the Triton fields are then unused
  return_lse: bool


# ----------------------------------------------------------------- in-kernel helpers
def row_mask(start, size, limit, ndim):
  """Which of the rows start .. start + size - 1 lie before `limit`: [size] (ndim 1) or [size, 1],
  the mask of a Triton-lowered load or store of a block that may overhang its array."""
  ok = start + jnp.arange(size) < limit
  return ok if ndim == 1 else ok[:, None]


def _load_rows(ref, start, size, limit, other=0.0):
  """ref[start:start + size] with rows past `limit` read as `other`."""
  return plgpu.load(ref.at[pl.ds(start, size)], mask=row_mask(start, size, limit, ref.ndim),
                    other=other)


def _store_rows(ref, start, value, limit):
  plgpu.store(ref.at[pl.ds(start, value.shape[0])], value,
              mask=row_mask(start, value.shape[0], limit, ref.ndim))


def _dot(a, b, contract):
  return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _qk(q, k):      # [m, D] x [n, D] -> [m, n]
  return _dot(q, k, ((1,), (1,)))


def _pv(p, v):      # [m, n] x [n, D] -> [m, D]
  return _dot(p, v, ((1,), (0,)))


def _tn(a, b):      # [m, n] x [m, D] -> [n, D]
  return _dot(a, b, ((0,), (0,)))


def _softmax_init(q):
  """(acc, running max, running sum) of the online softmax of q's [bq, D] rows."""
  bq = q.shape[0]
  return (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
          jnp.zeros((bq,), jnp.float32))


def _softmax_update(carry, s, v, masked: bool):
  """One tile of the base-2 online softmax: logits s [bq, n] (log2 scale) over values v [n, D].
  `masked`: s may hold -inf, so a row with no visible key yet keeps m = -inf and is
  exponentiated against 0."""
  acc, m, l = carry
  m_new = jnp.maximum(m, s.max(-1))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
  alpha = jnp.exp2(m - m_use)
  p = jnp.exp2(s - m_use[:, None])
  return alpha[:, None] * acc + _pv(p.astype(v.dtype), v), m_new, alpha * l + p.sum(-1)


def _store_softmax(o_ref, lse_ref, start, carry, limit):
  """The normalised output and the natural-log lse of rows start.. (rows past `limit` not
  stored); a row that saw no key gets 0 and -inf."""
  acc, m, l = carry
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  _store_rows(o_ref, start, (acc / l_safe[:, None]).astype(o_ref.dtype), limit)
  _store_rows(lse_ref, start, jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) / LOG2E), limit)


# ----------------------------------------------------------------------- forward
def _fwd_kernel(ids_ref, nfull_ref, count_ref, mids_ref, masks_ref, q_ref, k_ref, v_ref,
                o_ref, lse_ref, *, cfg: _Config, lq, lk, bq, bk, per_head):
  u = pl.program_id(0)
  hl = pl.program_id(2) if per_head else 0
  q = _load_rows(q_ref, u * bq, bq, lq)
  qk_scale = cfg.scale * LOG2E

  def visit(t, carry, partial):
    j = ids_ref[hl, u, t]
    if partial or lk < bk:
      k = _load_rows(k_ref, j * bk, bk, lk)
      v = _load_rows(v_ref, j * bk, bk, lk)
    else:  # a full tile never holds the key tail: plain, unpredicated loads
      k, v = k_ref[pl.ds(j * bk, bk)], v_ref[pl.ds(j * bk, bk)]
    s = _qk(q, k) * qk_scale
    if partial:
      s = jnp.where(masks_ref[mids_ref[hl, u, t]] != 0, s, -jnp.inf)
    return _softmax_update(carry, s, v, masked=partial)

  n_full, count = nfull_ref[hl, u], count_ref[hl, u]
  carry = lax.fori_loop(0, n_full, functools.partial(visit, partial=False), _softmax_init(q))
  carry = lax.fori_loop(n_full, count, functools.partial(visit, partial=True), carry)
  _store_softmax(o_ref, lse_ref, u * bq, carry, lq)


def _layout_arrays(layout: BlockLayout, transposed: bool):
  if transposed:
    arrays = (layout.q_ids, layout.q_full, layout.q_count, layout.q_mask, layout.masks)
  else:
    arrays = (layout.kv_ids, layout.kv_full, layout.kv_count, layout.kv_mask, layout.masks)
  return [jnp.asarray(a) for a in arrays]


def _whole(a):
  return pl.BlockSpec(a.shape, lambda *_: (0,) * len(a.shape))


def _seq_spec(x):
  """[B, L, H, D] -> the [L, D] slab of one (batch, head)."""
  return pl.BlockSpec((pl.squeezed, x.shape[1], pl.squeezed, x.shape[3]),
                      lambda i, b, h: (b, 0, h, 0))


def _row_spec(lq):
  """[B, H, Lq] -> the [Lq] row of one (batch, head)."""
  return pl.BlockSpec((pl.squeezed, pl.squeezed, lq), lambda i, b, h: (b, h, 0))


def _forward(q, k, v, layout: BlockLayout, cfg: _Config, with_lse: bool = True):
  """(out, lse); lse may be None when not `with_lse`."""
  if cfg.mosaic:
    outs = sparse_attention_mgpu.forward(q, k, v, layout, cfg.scale, with_lse=with_lse)
    return outs if with_lse else (outs, None)
  b, lq, h, _ = q.shape
  arrays = _layout_arrays(layout, transposed=False)
  kernel = functools.partial(_fwd_kernel, cfg=cfg, lq=lq, lk=k.shape[1], bq=layout.block_q,
                             bk=layout.block_k, per_head=layout.heads > 1)
  return pl.pallas_call(
      kernel,
      grid=(layout.num_q_blocks, b, h),
      in_specs=[_whole(a) for a in arrays] + [_seq_spec(q), _seq_spec(k), _seq_spec(v)],
      out_specs=[_seq_spec(q), _row_spec(lq)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, lq), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret,
      name='block_sparse_attention_fwd',
  )(*arrays, q, k, v)


# ---------------------------------------------------------------------- backward
def _bwd_tile(q, k, v, do, lse2, delta, tile, qk_scale):
  """p and dS of one [sq, sk] tile (lse2 in base 2, +inf on empty rows)."""
  s = _qk(q, k) * qk_scale
  if tile is not None:
    s = jnp.where(tile != 0, s, -jnp.inf)
  p = jnp.exp2(s - lse2[:, None])
  ds = p * (_qk(do, v) - delta[:, None])
  return p, ds


def _query_rows(q_ref, do_ref, lse_ref, delta_ref, q0, sq: int, lq: int):
  """The backward pass's query-side rows q0 .. q0 + sq: q, dO, log2-sum-exp (inf past lq), delta."""
  return (_load_rows(q_ref, q0, sq, lq), _load_rows(do_ref, q0, sq, lq),
          _load_rows(lse_ref, q0, sq, lq, other=jnp.inf), _load_rows(delta_ref, q0, sq, lq))


def _dkv_kernel(ids_ref, nfull_ref, count_ref, mids_ref, masks_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, cfg: _Config, lq, lk, bq, bk,
                per_head):
  sq, sk = cfg.bwd_block_q, cfg.bwd_block_k
  pid = pl.program_id(0)
  j, c = lax.div(pid, bk // sk), lax.rem(pid, bk // sk)
  hl = pl.program_id(2) if per_head else 0
  k0 = j * bk + c * sk
  k = _load_rows(k_ref, k0, sk, lk)
  v = _load_rows(v_ref, k0, sk, lk)

  def visit(t, carry, partial):
    dk, dv = carry
    u = ids_ref[hl, j, t]
    for r in range(bq // sq):
      q0 = u * bq + r * sq
      q, do, lse2, delta = _query_rows(q_ref, do_ref, lse_ref, delta_ref, q0, sq, lq)
      tile = (masks_ref[mids_ref[hl, j, t], pl.ds(r * sq, sq), pl.ds(c * sk, sk)]
              if partial else None)
      p, ds = _bwd_tile(q, k, v, do, lse2, delta, tile, cfg.scale * LOG2E)
      dv = dv + _tn(p.astype(do.dtype), do)
      dk = dk + _tn(ds.astype(q.dtype), q)
    return dk, dv

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  n_full, count = nfull_ref[hl, j], count_ref[hl, j]
  carry = lax.fori_loop(0, n_full, functools.partial(visit, partial=False), init)
  dk, dv = lax.fori_loop(n_full, count, functools.partial(visit, partial=True), carry)
  _store_rows(dk_ref, k0, (dk * cfg.scale).astype(dk_ref.dtype), lk)
  _store_rows(dv_ref, k0, dv.astype(dv_ref.dtype), lk)


def _dq_kernel(ids_ref, nfull_ref, count_ref, mids_ref, masks_ref, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, dq_ref, *, cfg: _Config, lq, lk, bq, bk, per_head):
  sq, sk = cfg.bwd_block_q, cfg.bwd_block_k
  pid = pl.program_id(0)
  u, r = lax.div(pid, bq // sq), lax.rem(pid, bq // sq)
  hl = pl.program_id(2) if per_head else 0
  q0 = u * bq + r * sq
  q, do, lse2, delta = _query_rows(q_ref, do_ref, lse_ref, delta_ref, q0, sq, lq)

  def visit(t, dq, partial):
    j = ids_ref[hl, u, t]
    for c in range(bk // sk):
      k0 = j * bk + c * sk
      if partial or lk < sk:
        k, v = _load_rows(k_ref, k0, sk, lk), _load_rows(v_ref, k0, sk, lk)
      else:
        k, v = k_ref[pl.ds(k0, sk)], v_ref[pl.ds(k0, sk)]
      tile = (masks_ref[mids_ref[hl, u, t], pl.ds(r * sq, sq), pl.ds(c * sk, sk)]
              if partial else None)
      _, ds = _bwd_tile(q, k, v, do, lse2, delta, tile, cfg.scale * LOG2E)
      dq = dq + _pv(ds.astype(k.dtype), k)
    return dq

  n_full, count = nfull_ref[hl, u], count_ref[hl, u]
  dq = lax.fori_loop(0, n_full, functools.partial(visit, partial=False),
                     jnp.zeros(q.shape, jnp.float32))
  dq = lax.fori_loop(n_full, count, functools.partial(visit, partial=True), dq)
  _store_rows(dq_ref, q0, (dq * cfg.scale).astype(dq_ref.dtype), lq)


def _backward(q, k, v, out, lse, do, dlse, layout: BlockLayout, cfg: _Config):
  b, lq, h, _ = q.shape
  lk = k.shape[1]
  # dS = P (dP - delta) with delta = rowsum(dO * O) - dlse (lse's own cotangent).
  delta = jnp.einsum('bqhd,bqhd->bhq', do.astype(jnp.float32), out.astype(jnp.float32)) - dlse
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
  if cfg.mosaic:
    return sparse_attention_mgpu.backward(q, k, v, do, lse2, delta, layout, cfg.scale)
  dims = dict(cfg=cfg, lq=lq, lk=lk, bq=layout.block_q, bk=layout.block_k,
              per_head=layout.heads > 1)
  params = plgpu.CompilerParams(num_warps=cfg.bwd_num_warps, num_stages=BWD_STAGES)
  seq_in = [_seq_spec(q), _seq_spec(k), _seq_spec(v), _seq_spec(do), _row_spec(lq), _row_spec(lq)]

  kv_arrays = _layout_arrays(layout, transposed=True)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, **dims),
      grid=(layout.num_k_blocks * (layout.block_k // cfg.bwd_block_k), b, h),
      in_specs=[_whole(a) for a in kv_arrays] + seq_in,
      out_specs=[_seq_spec(k), _seq_spec(v)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params, interpret=cfg.interpret, name='block_sparse_attention_dkv',
  )(*kv_arrays, q, k, v, do, lse2, delta)

  q_arrays = _layout_arrays(layout, transposed=False)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, **dims),
      grid=(layout.num_q_blocks * (layout.block_q // cfg.bwd_block_q), b, h),
      in_specs=[_whole(a) for a in q_arrays] + seq_in,
      out_specs=_seq_spec(q),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params, interpret=cfg.interpret, name='block_sparse_attention_dq',
  )(*q_arrays, q, k, v, do, lse2, delta)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, layout, cfg):
  """out, or (out, lse) with cfg.return_lse."""
  out, lse = _forward(q, k, v, layout, cfg, with_lse=cfg.return_lse)
  return (out, lse) if cfg.return_lse else out


def _attention_fwd(q, k, v, layout, cfg):
  out, lse = _forward(q, k, v, layout, cfg)
  return ((out, lse) if cfg.return_lse else out), (q, k, v, out, lse)


def _attention_bwd(layout, cfg, residuals, cotangents):
  q, k, v, out, lse = residuals
  do, dlse = cotangents if cfg.return_lse else (cotangents, jnp.zeros_like(lse))
  return _backward(q, k, v, out, lse, do.astype(q.dtype), dlse, layout, cfg)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ------------------------------------------------------------------------ public
def _check(q, k, v, layout: BlockLayout, bwd_block_q: int, bwd_block_k: int) -> None:
  if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
    raise ValueError(f'expected q [B, Lq, H, D], k and v [B, Lk, H, D]; got {q.shape}, '
                     f'{k.shape}, {v.shape}')
  if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
    raise ValueError(f'q {q.shape} and k {k.shape} disagree in batch, heads or head dim')
  if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
    raise ValueError(f'q, k, v must share one of float32/bfloat16/float16, got '
                     f'{q.dtype}, {k.dtype}, {v.dtype}')
  d = q.shape[3]
  if d < 16 or d > MAX_HEAD_DIM or d & (d - 1):
    raise ValueError(f'head dim must be a power of two in [16, {MAX_HEAD_DIM}], got {d}')
  capacity = layout.num_k_blocks * layout.block_k
  if q.shape[1] != layout.lq or not layout.lk <= k.shape[1] <= capacity:
    raise ValueError(f'layout is for lq={layout.lq}, lk={layout.lk}: q length must be {layout.lq} and k '
                     f'length in [{layout.lk}, {capacity}]; got {q.shape[1]} and {k.shape[1]}')
  if layout.heads not in (1, q.shape[2]):
    raise ValueError(f'layout has {layout.heads} heads; q has {q.shape[2]} (use 1 or that)')
  for name, sub, blk in (('bwd_block_q', bwd_block_q, layout.block_q),
                         ('bwd_block_k', bwd_block_k, layout.block_k)):
    if sub < 1 or blk % sub:
      raise ValueError(f'{name}={sub} must divide the layout block {blk}')


def _tuning(d: int, layout: BlockLayout, given: dict) -> dict:
  """Triton settings: those given, else the best measured on an H100 (NOTES.md)."""
  wide = d > 64
  best = dict(bwd_block_q=128 if wide else 64, bwd_block_k=64,
              num_warps=8 if wide and layout.block_q >= 128 else 4,
              bwd_num_warps=8 if wide else 4,
              # Three stages of 128 x 128 key/value tiles need Hopper's shared memory.
              num_stages=3 if wide and dispatch.is_hopper() else 2)
  out = {k: best[k] if given[k] is None else given[k] for k in best}
  out['bwd_block_q'] = min(out['bwd_block_q'], layout.block_q)
  out['bwd_block_k'] = min(out['bwd_block_k'], layout.block_k)
  return out


def block_sparse_attention(q, k, v, layout: BlockLayout, *, scale: Optional[float] = None,
                           return_lse: bool = False, impl: str = 'auto',
                           bwd_block_q: Optional[int] = None, bwd_block_k: Optional[int] = None,
                           num_warps: Optional[int] = None, bwd_num_warps: Optional[int] = None,
                           num_stages: Optional[int] = None):
  """Softmax attention over the tiles of `layout`; differentiable (custom VJP).

  q [B, Lq, H, D], k and v [B, Lk, H, D] (D a power of two <= 128) -> out [B, Lq, H, D]
  and, with `return_lse`, lse [B, H, Lq] float32 (natural log; -inf on query rows
  that see no key, whose output is 0). `scale` multiplies q.k (default 1/sqrt(D)).
  k and v may run past the layout's lk up to its last key block (a KV cache with
  spare rows, which must be finite): keys past lk are never attended and get no
  gradient. `impl`: see `pallas_kernels.dispatch`; on a Hopper 'auto' runs the
  forward and backward in Mosaic GPU where `sparse_attention_mgpu.unsupported`
  allows (lengths that are not multiples of 8 are padded for it: a copy of q, k,
  v). The Triton backward walks sub-blocks of [bwd_block_q, bwd_block_k] inside
  the layout's tiles. `num_warps`, `bwd_num_warps` and `num_stages`
  (forward) are Triton's; left as None, they take the values measured best on an
  H100 for the head dim.
  """
  t = _tuning(q.shape[-1], layout,
              dict(bwd_block_q=bwd_block_q, bwd_block_k=bwd_block_k, num_warps=num_warps,
                   bwd_num_warps=bwd_num_warps, num_stages=num_stages))
  _check(q, k, v, layout, t['bwd_block_q'], t['bwd_block_k'])
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  impl = dispatch.resolve(impl, sparse_attention_mgpu.unsupported(q, k, layout))
  if impl == 'reference':
    lk = layout.lk
    out, lse = reference.masked_attention(q, k[:, :lk], v[:, :lk], layout.dense(), scale)
    return (out, lse) if return_lse else out
  cfg = _Config(scale, impl == 'interpret', t['bwd_block_q'], t['bwd_block_k'], t['num_warps'],
                t['bwd_num_warps'], t['num_stages'], mosaic=impl == 'mosaic', return_lse=return_lse)
  if impl != 'mosaic':
    return _attention(q, k, v, layout, cfg)
  # TMA moves rows in eights: pad to a multiple of 8 (inside the layout's last blocks).
  # Padded keys lie past lk, so no query sees them; padded queries are cut off below
  # and their zero cotangents add nothing to dK, dV.
  lq = q.shape[1]
  pad = lambda x: jnp.pad(x, ((0, 0), (0, -x.shape[1] % 8), (0, 0), (0, 0)))
  res = _attention(pad(q), pad(k), pad(v), layout, cfg)
  return (res[0][:, :lq], res[1][..., :lq]) if return_lse else res[:, :lq]
