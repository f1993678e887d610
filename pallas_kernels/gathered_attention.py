"""Gathered-key flash attention in Pallas (Triton lowering), forward only: SparVAR's CS4A.

Query group g (queries [g * group, (g + 1) * group)) attends only to the key tokens
idx[b, h, g, :], a traced list. One program per (query block, batch, head) walks its
group's list a tile of block_k entries at a time: it gathers those K and V rows
into registers with an index-array load, masks the padding entries (outside
[0, kv_len)) and runs a base-2 online softmax over them. Lq and n need not be
block multiples: loads and stores past them are masked (no padding copies).
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

from pallas_kernels import dispatch, reference
from pallas_kernels.sparse_attention import (DTYPES, LOG2E, _load_rows, _qk, _row_spec, _seq_spec,
                                             _softmax_init, _softmax_update, _store_softmax)

BLOCK_Q_CHOICES = (64, 32, 16)   # the default block_q: the largest dividing `group`
MOSAIC = ("gathered_attention has no Mosaic GPU kernel: Hopper's TMA copies rectangular "
          "boxes and has no row gather (TMA gather4 is Blackwell-only), and Pallas Mosaic "
          "GPU exposes no cp.async or per-row gather load; impl='auto' runs the Triton "
          "lowering on Hopper")


@dataclasses.dataclass(frozen=True)
class GroupConfig:
  """Static settings of a per-query-group kernel (this one, `column_sums`)."""
  group: int
  scale: float
  kv_len: int
  block_q: int
  block_k: int


def _kernel(idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: GroupConfig):
  bq, bk = cfg.block_q, cfg.block_k
  lq, d = q_ref.shape
  n = idx_ref.shape[1]
  i = pl.program_id(0)
  g = lax.div(i, cfg.group // bq)   # block_q divides group: a block lies in one group
  q = _load_rows(q_ref, i * bq, bq, lq)
  qk_scale = cfg.scale * LOG2E
  cols = jnp.arange(d)

  def visit(t, carry):
    ids = plgpu.load(idx_ref.at[g, pl.ds(t * bk, bk)], mask=t * bk + jnp.arange(bk) < n,
                     other=-1)
    valid = (ids >= 0) & (ids < cfg.kv_len)
    # Masked lanes still get an in-range row: interpret mode computes their addresses.
    rows = jnp.where(valid, ids, 0)[:, None]
    both = jnp.broadcast_to(valid[:, None], (bk, d))
    k = plgpu.load(k_ref.at[rows, cols[None, :]], mask=both, other=0)
    v = plgpu.load(v_ref.at[rows, cols[None, :]], mask=both, other=0)
    s = jnp.where(valid[None, :], _qk(q, k) * qk_scale, -jnp.inf)
    return _softmax_update(carry, s, v, masked=True)

  carry = lax.fori_loop(0, pl.cdiv(n, bk), visit, _softmax_init(q))
  _store_softmax(o_ref, lse_ref, i * bq, carry, lq)


@dispatch.per_shape(4, 5, 6, 7)
def _forward(q, k, v, idx, cfg: GroupConfig, interpret: bool, num_warps: int, num_stages: int):
  b, lq, h, _ = q.shape
  g, n = idx.shape[2:]
  return pl.pallas_call(
      functools.partial(_kernel, cfg=cfg),
      grid=(pl.cdiv(lq, cfg.block_q), b, h),
      in_specs=[pl.BlockSpec((pl.squeezed, pl.squeezed, g, n), lambda i, b, h: (b, h, 0, 0)),
                _seq_spec(q), _seq_spec(k), _seq_spec(v)],
      out_specs=[_seq_spec(q), _row_spec(lq)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, lq), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name='gathered_attention_fwd',
  )(idx.astype(jnp.int32), q, k, v)


# ------------------------------------------------------------------------ public
def _pow2(x: int) -> bool:
  return x >= 16 and not x & (x - 1)


def default_block_q(group: int) -> int:
  """The largest of 64, 32, 16 that divides `group`."""
  for bq in BLOCK_Q_CHOICES:
    if group % bq == 0:
      return bq
  raise ValueError(f'group={group} is divisible by none of {BLOCK_Q_CHOICES}: a query block '
                   'must not straddle two groups; pass a group that is a multiple of 16')


def _check(q, k, v, idx, group: int, kv_len: int, block_q: int, block_k: int) -> None:
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or idx.ndim != 4:
    raise ValueError(f'expected q [B, Lq, H, D], k and v [B, Lk, H, D], idx [B, H, G, n]; got '
                     f'q {q.shape}, k {k.shape}, v {v.shape}, idx {idx.shape}')
  b, lq, h, _ = q.shape
  if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
    raise ValueError(f'q, k, v must share one of float32/bfloat16/float16, got '
                     f'{q.dtype}, {k.dtype}, {v.dtype}')
  check_group_kernel(q, k, group, kv_len, block_q, block_k)
  if not jnp.issubdtype(idx.dtype, jnp.integer):
    raise ValueError(f'idx must be integers, got {idx.dtype}')
  if group < 1 or idx.shape[:2] != (b, h) or idx.shape[2] != pl.cdiv(lq, group):
    raise ValueError(f'idx {idx.shape} must be [B, H, G, n] = [{b}, {h}, ceil(Lq / group) = '
                     f'{pl.cdiv(lq, max(group, 1))}, n] for q {q.shape} and group={group}')
  if idx.shape[3] < 1:
    raise ValueError(f'idx {idx.shape} lists no key (n = 0)')


def check_group_kernel(q, k, group: int, kv_len: int, block_q: int, block_k: int) -> None:
  """What every per-query-group kernel (this one, `column_sums`) needs of q [B, Lq, H, D], k
  [B, Lk, H, D], the valid key count and its tiles."""
  (b, _, h, d), lk = q.shape, k.shape[1]
  if (k.shape[0], k.shape[2], k.shape[3]) != (b, h, d):
    raise ValueError(f'q {q.shape} and k {k.shape} disagree in batch, heads or head dim')
  if not _pow2(d):
    raise ValueError(f'head dim must be a power of two >= 16, got {d} (q {q.shape})')
  if not 1 <= kv_len <= lk:
    raise ValueError(f'kv_len={kv_len} must be in [1, Lk = {lk}] (k {k.shape})')
  if not _pow2(block_q) or group % block_q:
    raise ValueError(f'block_q={block_q} must be a power of two >= 16 dividing group={group}')
  if not _pow2(block_k):
    raise ValueError(f'block_k={block_k} must be a power of two >= 16')


def gathered_attention(q, k, v, idx, *, group: int, scale: Optional[float] = None,
                       kv_len: Optional[int] = None, impl: str = 'auto', return_lse: bool = False,
                       block_q: Optional[int] = None, block_k: Optional[int] = None,
                       num_warps: Optional[int] = None, num_stages: int = 2):
  """Softmax attention of each query group over its own gathered keys (forward only).

  q [B, Lq, H, D], k and v [B, Lk, H, D] (D a power of two >= 16; a KV cache may
  have spare rows: only the first `kv_len`, default Lk, are keys), idx [B, H, G, n]
  int with G = ceil(Lq / group): queries [g * group, (g + 1) * group) attend to the
  keys idx[b, h, g, :]. Entries outside [0, kv_len) are padding, never attended.
  The caller deduplicates: a key listed twice counts twice in the softmax.
  -> out [B, Lq, H, D] in q's dtype and, with `return_lse`, lse [B, H, Lq] float32
  (natural log); a query row with no valid key gives out 0 and lse -inf. `scale`
  multiplies q.k (default 1/sqrt(D)). `impl`: see `pallas_kernels.dispatch` (no
  'mosaic': see MOSAIC). The kernel runs [block_q, block_k] tiles; block_q must
  divide `group` (default: the largest of 64, 32, 16 that does); block_k defaults to
  32 at head dims >= 128, else 64 (the best measured). `num_warps`
  (default 4, 8 for block_q 128) and `num_stages` are Triton's.
  """
  kv_len = k.shape[1] if kv_len is None else int(kv_len)
  block_q = default_block_q(group) if block_q is None else block_q
  # Measured best on an H200 (NOTES.md): 32 at head dim 128, 64 at 64.
  block_k = (32 if q.shape[-1] >= 128 else 64) if block_k is None else block_k
  _check(q, k, v, idx, group, kv_len, block_q, block_k)
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  impl = dispatch.resolve(impl, MOSAIC)
  if impl == 'reference':
    out, lse = reference.gathered_attention(q, k, v, idx, group, scale, kv_len)
  else:
    cfg = GroupConfig(group, scale, kv_len, block_q, block_k)
    warps = (4 if block_q <= 64 else 8) if num_warps is None else num_warps
    out, lse = _forward(q, k, v, idx, cfg, impl == 'interpret', warps, num_stages)
  return (out, lse) if return_lse else out
