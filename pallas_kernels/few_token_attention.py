"""Softmax attention over a few tokens in Pallas (Triton lowering): one program per (batch, head)
holds all of its queries and keys, so a call is one kernel with neither a key loop nor an online
softmax. Meant for the attention of E-CAR's denoiser blocks at sampling (a stage's 4-64 tokens),
where cuDNN's call costs a memset and a ~4 us launch gap around 5.5 us of work and XLA's
attention is several kernels (benchmarks/RESULTS.md, "E-CAR's samplers on cuBLAS GEMMs").

Triton's tensors have power-of-two sizes: a program reads its (batch, head)'s [L, D] slab of
q, k, v [B, L, H, D] in place as a block with L and D rounded up to powers of two (at least 16,
the smallest Triton dot), masked loads filling the overhang with zeros and a masked store
writing only the real rows and columns, so no copy runs around the kernel; the padded keys are
masked out of the softmax. A packed qkv [B, L, 3, H, D] (a fused projection's output) is read
the same way, each of q, k and v at its slot of the third axis. The backward pass is the
reference's: the `cudnn` attention backend runs the kernel only where a call is not
differentiated, training keeps cuDNN.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch, reference
from pallas_kernels.sparse_attention import DTYPES, LOG2E, MAX_HEAD_DIM, _pv, _qk

MAX_TOKENS = 128   # queries or keys a call may hold: one program's logits [Lq, Lk] sit in registers
# One program's padded q, k and v: Triton stages a dot's operands in shared memory (an A100 has
# 164 KB an SM, a Hopper 228), so a call that holds more runs elsewhere.
MAX_BYTES = 96 * 1024


def _padded(n: int) -> int:
  return max(16, pl.next_power_of_2(n))


def _kernel(q_ref, k_ref, v_ref, o_ref, *, lq: int, lk: int, d: int, scale: float):
  """One (batch, head): q [Lq_p, D_p] and k, v [Lk_p, D_p] blocks of [B, L, H, D] arrays, read
  where row < Lq (Lk) and column < D, zeros elsewhere -> o [Lq_p, D_p], stored likewise."""
  within = lambda rows, n: (jnp.arange(rows)[:, None] < n) & (jnp.arange(q_ref.shape[1])[None, :] < d)
  load = lambda ref, n: plgpu.load(ref, mask=within(ref.shape[0], n), other=0.0)
  k, v = load(k_ref, lk), load(v_ref, lk)
  s = _qk(load(q_ref, lq), k) * (scale * LOG2E)
  if lk < k.shape[0]:
    s = jnp.where(jnp.arange(k.shape[0])[None, :] < lk, s, -jnp.inf)
  p = jnp.exp2(s - s.max(-1, keepdims=True))
  o = _pv(p.astype(v.dtype), v) / p.sum(-1, keepdims=True)
  plgpu.store(o_ref, o.astype(o_ref.dtype), mask=within(o_ref.shape[0], lq))


def _operands(q, k, v) -> tuple:
  """The (array, slot) q, k and v are read from: with k and v None, q is a packed qkv [B, L, 3, H,
  D] and slot its third axis's index; else each its own [B, L, H, D] array."""
  return ((q, 0), (q, 1), (q, 2)) if k is None else ((q, None), (k, None), (v, None))


def _split(q, k, v) -> tuple:
  return tuple(a if s is None else a[:, :, s] for a, s in _operands(q, k, v))


@dispatch.per_shape(3, 4, 5)
def _forward(q, k, v, lk: int, scale: float, interpret: bool):
  """Keys [0, lk) of k, v; the rows after them (a KV cache's spare rows) are never read."""
  (b, lq), (h, d) = q.shape[:2], q.shape[-2:]
  d_p = _padded(d)

  def spec(n: int, slot: Optional[int]):
    if slot is None:
      return pl.BlockSpec((pl.squeezed, _padded(n), pl.squeezed, d_p), lambda i, j: (i, 0, j, 0))
    return pl.BlockSpec((pl.squeezed, _padded(n), pl.squeezed, pl.squeezed, d_p), lambda i, j: (i, 0, slot, j, 0))

  operands = _operands(q, k, v)
  return pl.pallas_call(
      functools.partial(_kernel, lq=lq, lk=lk, d=d, scale=scale),
      grid=(b, h),
      in_specs=[spec(n, slot) for (_, slot), n in zip(operands, (lq, lk, lk))],
      out_specs=spec(lq, None),
      out_shape=jax.ShapeDtypeStruct((b, lq, h, d), q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name='few_token_attention',
  )(*(a for a, _ in operands))


def _reference(q, k, v, lk: int, scale: float):
  q, k, v = _split(q, k, v)
  k, v = k[:, :lk], v[:, :lk]
  return reference.masked_attention(q, k, v, jnp.ones((1, q.shape[1], lk), bool), scale)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, lk, scale, interpret):
  return _forward(q, k, v, lk, scale, interpret)


def _attention_fwd(q, k, v, lk, scale, interpret):
  return _forward(q, k, v, lk, scale, interpret), (q, k, v)


def _attention_bwd(lk, scale, interpret, residuals, do):
  del interpret
  return jax.vjp(functools.partial(_reference, lk=lk, scale=scale), *residuals)[1](do)


_attention.defvjp(_attention_fwd, _attention_bwd)


def unsupported(q, k=None, v=None, kv_len: Optional[int] = None) -> str:
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
  lk = k.shape[1] if kv_len is None else kv_len
  if max(q.shape[1], lk) > MAX_TOKENS:
    return f'at most {MAX_TOKENS} queries and keys, got Lq={q.shape[1]}, {lk} keys'
  if _padded(q.shape[3]) > MAX_HEAD_DIM:
    return f'head dim at most {MAX_HEAD_DIM}, got {q.shape[3]}'
  if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
    return f'q, k, v of one dtype among {[jnp.dtype(t).name for t in DTYPES]}, got {q.dtype}, {k.dtype}, {v.dtype}'
  held = (_padded(q.shape[1]) + 2 * _padded(lk)) * _padded(q.shape[3]) * q.dtype.itemsize
  if held > MAX_BYTES:
    return (f'a (batch, head) holds {held // 1024} KiB of padded q, k, v (Lq={q.shape[1]}, {lk} keys, '
            f'D={q.shape[3]}, {q.dtype}), at most {MAX_BYTES // 1024}')
  return ''


def few_token_attention(q, k=None, v=None, *, scale: Optional[float] = None, kv_len: Optional[int] = None,
                        impl: str = 'auto'):
  """Softmax attention, every query over every key: q [B, Lq, H, D], k and v [B, Lk, H, D] ->
  [B, Lq, H, D] in q's dtype; logits and softmax in float32, scale default 1/sqrt(D). Only the
  first `kv_len` keys (default Lk) count, a KV cache's buffer read in place: Lq and kv_len at most
  MAX_TOKENS, D at most MAX_HEAD_DIM. With k and v None, q is a packed qkv [B, L, 3, H, D] (a
  fused qkv projection's output), its three parts read in place. `impl`: see
  `pallas_kernels.dispatch` (no Mosaic GPU kernel: 'auto' runs the Triton lowering on every NVIDIA
  GPU)."""
  why = unsupported(q, k, v, kv_len)
  if why:
    raise ValueError(f'few_token_attention: {why}')
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  impl = dispatch.resolve(impl)
  if impl == 'mosaic':
    raise ValueError(f"impl='mosaic': {dispatch.NO_MOSAIC}")
  lk = q.shape[1] if k is None else k.shape[1] if kv_len is None else kv_len
  if impl == 'reference':
    return _reference(q, k, v, lk, scale)
  return _attention(q, k, v, lk, scale, impl == 'interpret')
