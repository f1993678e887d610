"""Softmax attention over a few tokens in Pallas (Triton lowering): one program per (batch, head)
holds all of its queries and keys, so a call is one kernel with neither a key loop nor an online
softmax. Meant for the attention of E-CAR's denoiser blocks at sampling (a stage's 4-64 tokens),
where cuDNN's call costs a memset and a ~4 us launch gap around 5.5 us of work and XLA's
attention is several kernels (benchmarks/RESULTS.md, "E-CAR's samplers on cuBLAS GEMMs").

Triton's tensors have power-of-two sizes: q, k, v are laid out [B, H, L, D] with L and D padded
to powers of two (at least 16, the smallest Triton dot), which XLA fuses into the ops that
produce them; the padded keys are masked, the padded queries and columns cut. The backward pass
is the reference's (training is not what the kernel is for).
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
from pallas_kernels.sparse_attention import DTYPES, LOG2E, _pv, _qk

MAX_TOKENS = 128   # queries or keys a call may hold: one program's logits [Lq, Lk] sit in registers
# One program's padded q, k and v: Triton stages a dot's operands in shared memory (an A100 has
# 164 KB an SM, a Hopper 228), so a call that holds more runs elsewhere.
MAX_BYTES = 96 * 1024


def _padded(n: int) -> int:
  return max(16, pl.next_power_of_2(n))


def _kernel(q_ref, k_ref, v_ref, o_ref, *, lk: int, scale: float):
  """One (batch, head): q [Lq_p, D_p], k and v [Lk_p, D_p] -> o [Lq_p, D_p]; keys from lk on masked."""
  k, v = k_ref[...], v_ref[...]
  s = _qk(q_ref[...], k) * (scale * LOG2E)
  if lk < k.shape[0]:
    s = jnp.where(jnp.arange(k.shape[0])[None, :] < lk, s, -jnp.inf)
  p = jnp.exp2(s - s.max(-1, keepdims=True))
  o_ref[...] = (_pv(p.astype(v.dtype), v) / p.sum(-1, keepdims=True)).astype(o_ref.dtype)


def _laid_out(x, length: int, dim: int):
  """[B, L, H, D] -> [B, H, length, dim], zero-padded."""
  x = jnp.swapaxes(x, 1, 2)
  return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, dim - x.shape[3])))


def _forward(q, k, v, scale: float, interpret: bool):
  b, lq, h, d = q.shape
  lq_p, lk_p, d_p = _padded(lq), _padded(k.shape[1]), _padded(d)
  spec = lambda n: pl.BlockSpec((pl.squeezed, pl.squeezed, n, d_p), lambda i, j: (i, j, 0, 0))
  out = pl.pallas_call(
      functools.partial(_kernel, lk=k.shape[1], scale=scale),
      grid=(b, h),
      in_specs=[spec(lq_p), spec(lk_p), spec(lk_p)],
      out_specs=spec(lq_p),
      out_shape=jax.ShapeDtypeStruct((b, h, lq_p, d_p), q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name='few_token_attention',
  )(_laid_out(q, lq_p, d_p), _laid_out(k, lk_p, d_p), _laid_out(v, lk_p, d_p))
  return jnp.swapaxes(out[:, :, :lq, :d], 1, 2)


def _reference(q, k, v, scale: float):
  return reference.masked_attention(q, k, v, jnp.ones((1, q.shape[1], k.shape[1]), bool), scale)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, scale, interpret):
  return _forward(q, k, v, scale, interpret)


def _attention_fwd(q, k, v, scale, interpret):
  return _forward(q, k, v, scale, interpret), (q, k, v)


def _attention_bwd(scale, interpret, residuals, do):
  del interpret
  return jax.vjp(functools.partial(_reference, scale=scale), *residuals)[1](do)


_attention.defvjp(_attention_fwd, _attention_bwd)


def unsupported(q, k, v) -> str:
  """Why few_token_attention does not take these inputs ('' when it does)."""
  if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
    return f'q [B, Lq, H, D], k and v [B, Lk, H, D] expected, got {q.shape}, {k.shape}, {v.shape}'
  if max(q.shape[1], k.shape[1]) > MAX_TOKENS:
    return f'at most {MAX_TOKENS} queries and keys, got Lq={q.shape[1]}, Lk={k.shape[1]}'
  if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
    return f'q, k, v of one dtype among {[jnp.dtype(t).name for t in DTYPES]}, got {q.dtype}, {k.dtype}, {v.dtype}'
  held = (_padded(q.shape[1]) + 2 * _padded(k.shape[1])) * _padded(q.shape[3]) * q.dtype.itemsize
  if held > MAX_BYTES:
    return (f'a (batch, head) holds {held // 1024} KiB of padded q, k, v (Lq={q.shape[1]}, Lk={k.shape[1]}, '
            f'D={q.shape[3]}, {q.dtype}), at most {MAX_BYTES // 1024}')
  return ''


def few_token_attention(q, k, v, *, scale: Optional[float] = None, impl: str = 'auto'):
  """Softmax attention, every query over every key: q [B, Lq, H, D], k and v [B, Lk, H, D] with
  Lq, Lk <= MAX_TOKENS -> [B, Lq, H, D] in q's dtype; logits and softmax in float32, scale
  default 1/sqrt(D). `impl`: see `pallas_kernels.dispatch` (no Mosaic GPU kernel: 'auto' runs
  the Triton lowering on every NVIDIA GPU)."""
  why = unsupported(q, k, v)
  if why:
    raise ValueError(f'few_token_attention: {why}')
  scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
  impl = dispatch.resolve(impl)
  if impl == 'mosaic':
    raise ValueError(f"impl='mosaic': {dispatch.NO_MOSAIC}")
  if impl == 'reference':
    return _reference(q, k, v, scale)
  return _attention(q, k, v, scale, impl == 'interpret')
