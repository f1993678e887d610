"""Column sums of attention probabilities per query group in Pallas (Triton lowering).

SparVAR's CS4A scores each key, per group of `group` consecutive queries, by the sum
over the group of the softmax probabilities P = softmax(scale q k^T). Given the rows'
log-sum-exp (the dense flash forward returns it), P[q, j] = exp(scale q.k_j - lse[q])
needs no second pass over the keys: one program per (key block, query group, batch x
head) loads its K tile once, walks the group's queries in sub-blocks of block_q
(S = q k^T in float32, base-2 exponentials) and sums the probabilities of each key
column in registers, then stores its [block_k] sums. Loads past Lq and past kv_len
are masked (no padding copies); spare KV-buffer rows from kv_len on are never read.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch, reference
from pallas_kernels.gathered_attention import GroupConfig, check_group_kernel, default_block_q
from pallas_kernels.sparse_attention import DTYPES, LOG2E, _load_rows, _qk, _store_rows

MOSAIC = ("group_column_sums has no Mosaic GPU kernel: not needed, the kernel (half the FLOPs "
          "of the dense forward it follows, no P V, no online softmax) is small next to that "
          "attention; impl='auto' runs the Triton lowering on NVIDIA GPUs")


def _kernel(q_ref, k_ref, lse_ref, o_ref, *, cfg: GroupConfig):
  bq, bk = cfg.block_q, cfg.block_k
  lq = q_ref.shape[0]
  j, g = pl.program_id(0), pl.program_id(1)
  k = _load_rows(k_ref, j * bk, bk, cfg.kv_len)   # rows past kv_len read as 0, never stored
  qk_scale = cfg.scale * LOG2E
  q0 = g * cfg.group

  def visit(t, acc):
    r0 = q0 + t * bq
    q = _load_rows(q_ref, r0, bq, lq)
    lse = _load_rows(lse_ref, r0, bq, lq, other=-jnp.inf)
    # Rows past Lq and rows with lse = -inf (no key) contribute exp2(-inf) = 0.
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
    p = jnp.exp2(_qk(q, k) * qk_scale - lse2[:, None])
    return acc + p.sum(0)

  # The group's rows below Lq, in sub-blocks of bq (the last group may be partial).
  steps = pl.cdiv(jnp.minimum(cfg.group, lq - q0), bq)
  acc = lax.fori_loop(0, steps, visit, jnp.zeros((bk,), jnp.float32))
  _store_rows(o_ref, j * bk, acc, cfg.kv_len)


@dispatch.per_shape(3, 4, 5, 6)
def _sums(q, k, lse, cfg: GroupConfig, interpret: bool, num_warps: int, num_stages: int):
  b, lq, h, d = q.shape
  g = pl.cdiv(lq, cfg.group)
  bh = lambda i: (lax.div(i, h), lax.rem(i, h))

  def seq(x):   # [B, L, H, D] -> the [L, D] slab of one (batch, head)
    return pl.BlockSpec((pl.squeezed, x.shape[1], pl.squeezed, d),
                        lambda j, gi, i: (bh(i)[0], 0, bh(i)[1], 0))

  return pl.pallas_call(
      functools.partial(_kernel, cfg=cfg),
      grid=(pl.cdiv(cfg.kv_len, cfg.block_k), g, b * h),
      in_specs=[seq(q), seq(k),
                pl.BlockSpec((pl.squeezed, pl.squeezed, lq), lambda j, gi, i: (*bh(i), 0))],
      out_specs=pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, cfg.kv_len),
                             lambda j, gi, i: (*bh(i), gi, 0)),
      out_shape=jax.ShapeDtypeStruct((b, h, g, cfg.kv_len), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name='group_column_sums',
  )(q, k, lse)


# ------------------------------------------------------------------------ public
def _check(q, k, lse, group: int, kv_len: int, block_q: int, block_k: int) -> None:
  if q.ndim != 4 or k.ndim != 4 or lse.ndim != 3:
    raise ValueError(f'expected q [B, Lq, H, D], k [B, Lk, H, D], lse [B, H, Lq]; got '
                     f'q {q.shape}, k {k.shape}, lse {lse.shape}')
  b, lq, h, _ = q.shape
  check_group_kernel(q, k, group, kv_len, block_q, block_k)
  if lse.shape != (b, h, lq):
    raise ValueError(f'lse {lse.shape} must be [B, H, Lq] = [{b}, {h}, {lq}] for q {q.shape}')
  if not q.dtype == k.dtype or q.dtype not in DTYPES:
    raise ValueError(f'q and k must share one of float32/bfloat16/float16, got '
                     f'{q.dtype}, {k.dtype}')
  if lse.dtype != jnp.float32:
    raise ValueError(f'lse must be float32 (as block_sparse_attention returns it), got {lse.dtype}')


def group_column_sums(q, k, lse, *, group: int, scale: Optional[float] = None,
                      kv_len: Optional[int] = None, impl: str = 'auto', block_k: int = 128,
                      block_q: Optional[int] = None, num_warps: Optional[int] = None,
                      num_stages: int = 2):
  """Column sums of the attention probabilities per query group (SparVAR's CS4A scores).

  q [B, Lq, H, D], k [B, Lk, H, D] (D a power of two >= 16; a KV buffer: only the first
  `kv_len`, default Lk, rows are keys), lse [B, H, Lq] float32, the natural-log
  log-sum-exp of each query row's logits over those keys (as
  `block_sparse_attention(..., return_lse=True)` returns it; a -inf row contributes 0)
  -> sums [B, H, G, kv_len] float32, G = ceil(Lq / group):
  sums[b, h, g, j] = sum over queries q of [g * group, (g + 1) * group), q < Lq, of
  exp(scale q.k_j - lse[b, h, q]). `scale` multiplies q.k (default 1/sqrt(D)).
  `impl`: see `pallas_kernels.dispatch` (no 'mosaic': see MOSAIC). The kernel runs
  [block_q, block_k] tiles; block_q must divide `group` (default: the largest of
  64, 32, 16 that does). `num_warps` (default 4, 8 above 64 x 64 tiles) and
  `num_stages` are Triton's.
  """
  kv_len = k.shape[1] if kv_len is None else int(kv_len)
  if group < 1:
    raise ValueError(f'group={group} must be >= 1')
  block_q = default_block_q(group) if block_q is None else block_q
  _check(q, k, lse, group, kv_len, block_q, block_k)
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  impl = dispatch.resolve(impl, MOSAIC)
  if impl == 'reference':
    return reference.group_column_sums(q, k, lse, group, scale, kv_len)
  cfg = GroupConfig(group, scale, kv_len, block_q, block_k)
  warps = (4 if block_q * block_k <= 64 * 64 else 8) if num_warps is None else num_warps
  return _sums(q, k, lse, cfg, impl == 'interpret', warps, num_stages)
