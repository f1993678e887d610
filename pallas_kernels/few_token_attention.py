"""Softmax attention over a few hundred tokens in Pallas (Triton lowering), reading q, k and v in
place: one program per (batch, head, block of queries), its keys in a static loop of blocks with
the online softmax (one block, a plain softmax, up to ONE_BLOCK tokens). Meant for sampling calls
where cuDNN's call costs a memset and a ~4 us launch gap around a few us of work and XLA's
attention is several kernels: E-CAR's denoiser blocks (a stage's 4-64 tokens,
benchmarks/RESULTS.md, "E-CAR's samplers on cuBLAS GEMMs"), and MAR's encoder and decoder (320
tokens, 80-wide heads, the encoder's per-sample key mask).

Triton's tensors have power-of-two sizes: a program reads its blocks of the [L, D] slab of q, k, v
[B, L, H, D] with rows and D rounded up to powers of two (at least 16, the smallest Triton dot),
masked loads filling the overhang with zeros and a masked store writing only the real rows and
columns, so no copy runs around the kernel; padded keys, and keys a `key_mask` [B, Lk] hides, are
masked out of the softmax. A packed qkv [B, L, 3, H, D] (a fused projection's output) is read the
same way, each of q, k and v at its slot of the third axis. The backward pass is the reference's:
the `cudnn` attention backend runs the kernel only where a call is not differentiated, training
keeps cuDNN.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch, reference
from pallas_kernels.sparse_attention import DTYPES, LOG2E, MAX_HEAD_DIM, _pv, _qk

MAX_TOKENS = 512   # queries or keys a call may hold (MAR's 320)
ONE_BLOCK = 128    # up to this many queries (keys), one block holds them all: logits [Lq, Lk] in registers


class Tiling(NamedTuple):
  """Past ONE_BLOCK tokens: the queries a program holds and the keys a step of its loop reads
  (powers of two, at least 16), and Triton's warps and pipeline stages a program."""
  block_q: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 1


# One program's padded q block and k, v blocks: Triton stages a dot's operands in shared memory (an
# A100 has 164 KB an SM, a Hopper 228), so a call that holds more runs elsewhere.
MAX_BYTES = 96 * 1024
# Programs a grid past one block should hold, about half an A100's (108 SMs) or H100's (132) SMs:
# at MAR-H's shapes on an H200, 71 queries over 320 keys in 16 heads take 8.1 us a call in blocks
# of 16 (80 programs) against 13.1 in blocks of 64 (32), and 320 queries 10.4 us in blocks of 64
# (80) against 13.0 in blocks of 32 (benchmarks/RESULTS.md, "Issue 39: the few-token kernel's query blocks").
MIN_PROGRAMS = 64


def _padded(n: int) -> int:
  return max(16, pl.next_power_of_2(n))


def _k_block(lk: int, tiling: Tiling) -> int:
  """Rows of a k, v block (a step of the key loop): all lk keys up to ONE_BLOCK, else tiling's."""
  return _padded(lk) if lk <= ONE_BLOCK else tiling.block_k


def _q_block(b: int, lq: int, lk: int, h: int, tiling: Tiling) -> int:
  """Rows of a q block (a program's queries): all lq in a call of one block (Lq and Lk at most
  ONE_BLOCK); else tiling's, halved (down to 16) while the grid holds fewer than MIN_PROGRAMS
  programs: a few queries over many keys (LazyMAR's cached encoder at batch 1, 71 over 320 in
  16 heads) spread over programs rather than one program a head."""
  if max(lq, lk) <= ONE_BLOCK:
    return _padded(lq)
  rows = min(_padded(lq), tiling.block_q)
  while rows > 16 and b * h * pl.cdiv(lq, rows) < MIN_PROGRAMS:
    rows //= 2
  return rows


def _kernel(q_ref, k_ref, v_ref, *refs, lq: int, lk: int, d: int, scale: float, bk: int):
  """One (batch, head, query block): a q block [Bq, D_p] of a [B, L, H, D] array and the k, v
  slabs [Lk_p, D_p] (with a key mask, its [Lk_p] row: refs = (mask, o)), read where row < Lq (Lk)
  and column < D, zeros elsewhere -> o [Bq, D_p], stored likewise."""
  *mask_ref, o_ref = refs
  bq, d_p = q_ref.shape
  rows_left = lq - pl.program_id(2) * bq
  within = lambda rows, n: (jnp.arange(rows)[:, None] < n) & (jnp.arange(d_p)[None, :] < d)
  q = plgpu.load(q_ref, mask=within(bq, rows_left), other=0.0)
  m = jnp.full((bq,), -1e30, jnp.float32)   # finite: a block of hidden keys leaves no NaN
  l = jnp.zeros((bq,), jnp.float32)
  acc = jnp.zeros((bq, d_p), jnp.float32)
  for start in range(0, lk, bk):
    keys = pl.ds(start, bk)
    k = plgpu.load(k_ref.at[keys], mask=within(bk, lk - start), other=0.0)
    v = plgpu.load(v_ref.at[keys], mask=within(bk, lk - start), other=0.0)
    seen = jnp.arange(bk) < lk - start
    if mask_ref:
      seen &= plgpu.load(mask_ref[0].at[keys], mask=seen, other=0) != 0
    s = jnp.where(seen[None, :], _qk(q, k) * (scale * LOG2E), -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp2(s - m_new[:, None])
    alpha = jnp.exp2(m - m_new)
    l = l * alpha + p.sum(-1)
    acc = acc * alpha[:, None] + _pv(p.astype(v.dtype), v)
    m = m_new
  o = acc / jnp.where(l > 0, l, 1.0)[:, None]   # a query that sees no key gives zeros
  plgpu.store(o_ref, o.astype(o_ref.dtype), mask=within(bq, rows_left))


def _operands(q, k, v) -> tuple:
  """The (array, slot) q, k and v are read from: with k and v None, q is a packed qkv [B, L, 3, H,
  D] and slot its third axis's index; else each its own [B, L, H, D] array."""
  return ((q, 0), (q, 1), (q, 2)) if k is None else ((q, None), (k, None), (v, None))


def _split(q, k, v) -> tuple:
  return tuple(a if s is None else a[:, :, s] for a, s in _operands(q, k, v))


@dispatch.per_shape(4, 5, 6, 7)
def _forward(q, k, v, key_mask, lk: int, scale: float, tiling: Tiling, interpret: bool):
  """Keys [0, lk) of k, v (those key_mask [B, Lk] int32 keeps, where given); the rows after them
  (a KV cache's spare rows) are never read."""
  (b, lq), (h, d) = q.shape[:2], q.shape[-2:]
  d_p, bq = _padded(d), _q_block(b, lq, lk, h, tiling)

  def spec(rows: int, slot: Optional[int], keys: bool):
    """Grid (batch i, head j, query block t) -> a block of `rows`: the t-th, or for keys the first."""
    row = lambda t: 0 if keys else t
    if slot is None:
      return pl.BlockSpec((pl.squeezed, rows, pl.squeezed, d_p), lambda i, j, t: (i, row(t), j, 0))
    return pl.BlockSpec((pl.squeezed, rows, pl.squeezed, pl.squeezed, d_p), lambda i, j, t: (i, row(t), slot, j, 0))

  operands = _operands(q, k, v)
  in_specs = [spec(bq, operands[0][1], False)] + [spec(_padded(lk), slot, True) for _, slot in operands[1:]]
  arrays = [a for a, _ in operands]
  if key_mask is not None:
    in_specs.append(pl.BlockSpec((pl.squeezed, _padded(lk)), lambda i, j, t: (i, 0)))
    arrays.append(key_mask)
  return pl.pallas_call(
      functools.partial(_kernel, lq=lq, lk=lk, d=d, scale=scale, bk=_k_block(lk, tiling)),
      grid=(b, h, pl.cdiv(lq, bq)),
      in_specs=in_specs,
      out_specs=spec(bq, None, False),
      out_shape=jax.ShapeDtypeStruct((b, lq, h, d), q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
      interpret=interpret,
      name='few_token_attention',
  )(*arrays)


def _reference(q, k, v, key_mask, lk: int, scale: float):
  q, k, v = _split(q, k, v)
  k, v = k[:, :lk], v[:, :lk]
  seen = jnp.ones((q.shape[0], lk), bool) if key_mask is None else key_mask[:, :lk] != 0
  return jax.vmap(lambda q, k, v, m: reference.masked_attention(
      q[None], k[None], v[None], jnp.broadcast_to(m, (1, q.shape[0], lk)), scale)[0][0])(q, k, v, seen)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q, k, v, key_mask, lk, scale, tiling, interpret):
  return _forward(q, k, v, key_mask, lk, scale, tiling, interpret)


def _attention_fwd(q, k, v, key_mask, lk, scale, tiling, interpret):
  return _forward(q, k, v, key_mask, lk, scale, tiling, interpret), (q, k, v, key_mask)


def _attention_bwd(lk, scale, tiling, interpret, residuals, do):
  del tiling, interpret
  q, k, v, key_mask = residuals
  grads = jax.vjp(lambda q, k, v: _reference(q, k, v, key_mask, lk, scale), q, k, v)[1](do)
  return (*grads, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def unsupported(q, k=None, v=None, kv_len: Optional[int] = None, key_mask=None, tiling: Tiling = Tiling()) -> str:
  """Why few_token_attention does not take these inputs ('' when it does)."""
  if k is None and v is None:
    if q.ndim != 5 or q.shape[2] != 3:
      return f'a packed qkv [B, L, 3, H, D] expected (k and v None), got {q.shape}'
    if kv_len is not None:
      return f'a packed qkv is self-attention over its own keys: no kv_len, got {kv_len}'
    q = k = v = jax.ShapeDtypeStruct(q.shape[:2] + q.shape[3:], q.dtype)
  if k is None or v is None or q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] \
      or q.shape[2:] != k.shape[2:]:
    return (f'q [B, Lq, H, D], k and v [B, Lk, H, D] expected, got {q.shape}, {getattr(k, "shape", k)}, '
            f'{getattr(v, "shape", v)}')
  if kv_len is not None and not 0 < kv_len <= k.shape[1]:
    return f'kv_len must be in (0, Lk = {k.shape[1]}], got {kv_len}'
  if key_mask is not None and tuple(key_mask.shape) != (q.shape[0], k.shape[1]):
    return f'key_mask [B, Lk] = {(q.shape[0], k.shape[1])} expected, got {tuple(key_mask.shape)}'
  lk = k.shape[1] if kv_len is None else kv_len
  if max(q.shape[1], lk) > MAX_TOKENS:
    return f'at most {MAX_TOKENS} queries and keys, got Lq={q.shape[1]}, {lk} keys'
  if _padded(q.shape[3]) > MAX_HEAD_DIM:
    return f'head dim at most {MAX_HEAD_DIM}, got {q.shape[3]}'
  if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
    return f'q, k, v of one dtype among {[jnp.dtype(t).name for t in DTYPES]}, got {q.dtype}, {k.dtype}, {v.dtype}'
  for name, rows in zip(('block_q', 'block_k'), tiling[:2]):
    if rows < 16 or rows & (rows - 1):
      return f'tiling.{name} must be a power of two of at least 16, got {rows}'
  rows = _q_block(q.shape[0], q.shape[1], lk, q.shape[-2], tiling) + 2 * _k_block(lk, tiling)
  held = rows * _padded(q.shape[3]) * q.dtype.itemsize
  if held > MAX_BYTES:
    return (f'a program holds {held // 1024} KiB of padded q, k, v blocks (Lq={q.shape[1]}, {lk} keys, '
            f'D={q.shape[3]}, {q.dtype}), at most {MAX_BYTES // 1024}')
  return ''


def few_token_attention(q, k=None, v=None, *, scale: Optional[float] = None, kv_len: Optional[int] = None,
                        key_mask=None, tiling: Optional[Tiling] = None, impl: str = 'auto'):
  """Softmax attention, every query over every key: q [B, Lq, H, D], k and v [B, Lk, H, D] ->
  [B, Lq, H, D] in q's dtype; logits and softmax in float32, scale default 1/sqrt(D). Only the
  first `kv_len` keys (default Lk) count, a KV cache's buffer read in place, and of them only those
  `key_mask` [B, Lk] bool (True = seen) keeps, where given; a query that sees no key gives zeros.
  Lq and kv_len at most MAX_TOKENS, D at most MAX_HEAD_DIM. With k and v None, q is a packed qkv
  [B, L, 3, H, D] (a fused qkv projection's output), its three parts read in place. `impl`: see
  `pallas_kernels.dispatch` (no Mosaic GPU kernel: 'auto' runs the Triton lowering on every NVIDIA
  GPU). `tiling` (default `Tiling()`) sets the blocks, warps and stages of calls over more than
  ONE_BLOCK tokens."""
  tiling = Tiling() if tiling is None else Tiling(*tiling)
  why = unsupported(q, k, v, kv_len, key_mask, tiling)
  if why:
    raise ValueError(f'few_token_attention: {why}')
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  impl = dispatch.resolve(impl)
  if impl == 'mosaic':
    raise ValueError(f"impl='mosaic': {dispatch.NO_MOSAIC}")
  lk = q.shape[1] if k is None else k.shape[1] if kv_len is None else kv_len
  key_mask = None if key_mask is None else jnp.asarray(key_mask).astype(jnp.int32)
  if impl == 'reference':
    return _reference(q, k, v, key_mask, lk, scale)
  return _attention(q, k, v, key_mask, lk, scale, tiling, impl == 'interpret')
