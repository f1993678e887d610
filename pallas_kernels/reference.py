"""Plain-jnp references of the kernels: the CPU fallback and the tests' ground truth.

They compute in the promoted dtype of their inputs with float32 at least, so a
float64 call (under `jax.enable_x64`) is the float64 reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def masked_attention(q, k, v, mask, scale: float):
  """Softmax attention under a token mask, empty query rows giving zeros.

  q [B, Lq, H, D], k and v [B, Lk, H, D], mask [Hm, Lq, Lk] bool (Hm = 1 or H)
  -> (out [B, Lq, H, D] in q's dtype, lse [B, H, Lq]; -inf on empty rows).
  """
  dt = jnp.promote_types(q.dtype, jnp.float32)
  s = jnp.einsum('bqhd,bkhd->bhqk', q.astype(dt), k.astype(dt)) * scale
  p, lse = _masked_softmax(s, jnp.asarray(mask)[None])
  o = jnp.einsum('bhqk,bkhd->bqhd', p, v.astype(dt))
  return o.astype(q.dtype), lse


def gathered_attention(q, k, v, idx, group: int, scale: float, kv_len: int):
  """Each query group attends to its own list of keys (SparVAR's CS4A top-k gathering).

  q [B, Lq, H, D], k and v [B, Lk, H, D] (rows from kv_len on unused), idx [B, H, G, n]
  int with G = ceil(Lq / group): queries [g * group, (g + 1) * group) attend to the keys
  idx[b, h, g]; entries outside [0, kv_len) are padding, and a key listed twice counts
  twice (a softmax over the n gathered columns, as the kernel computes it)
  -> (out [B, Lq, H, D] in q's dtype, lse [B, H, Lq]; -inf on empty rows).
  """
  b, lq, h, d = q.shape
  g, n = idx.shape[2:]
  dt = jnp.promote_types(q.dtype, jnp.float32)
  valid = (idx >= 0) & (idx < kv_len)                                  # [B, H, G, n]
  rows = jnp.where(valid, idx, 0).reshape(b, h, g * n, 1)

  def gather(x):  # [B, Lk, H, D] -> the listed rows [B, H, G, n, D]
    x = x[:, :kv_len].transpose(0, 2, 1, 3)
    return jnp.take_along_axis(x, rows, axis=2).reshape(b, h, g, n, d).astype(dt)

  qg = jnp.pad(q.astype(dt), ((0, 0), (0, g * group - lq), (0, 0), (0, 0)))
  s = jnp.einsum('bgqhd,bhgnd->bhgqn', qg.reshape(b, g, group, h, d), gather(k)) * scale
  p, lse = _masked_softmax(s, valid[:, :, :, None])
  o = jnp.einsum('bhgqn,bhgnd->bgqhd', p, gather(v)).reshape(b, g * group, h, d)
  return o[:, :lq].astype(q.dtype), lse.reshape(b, h, g * group)[..., :lq]


def group_column_sums(q, k, lse, group: int, scale: float, kv_len: int):
  """Column sums of the attention probabilities per query group (SparVAR's CS4A scores).

  q [B, Lq, H, D], k [B, Lk, H, D] (rows from kv_len on unused), lse [B, H, Lq], the
  natural-log log-sum-exp of each query row over the first kv_len keys (-inf rows
  contribute 0) -> sums [B, H, ceil(Lq / group), kv_len]: sums[b, h, g, j] = sum over
  queries q of [g * group, (g + 1) * group), q < Lq, of exp(scale q.k_j - lse[b, h, q]).
  """
  b, lq, h, _ = q.shape
  g = -(-lq // group)
  dt = jnp.promote_types(q.dtype, jnp.float32)
  s = jnp.einsum('bqhd,bkhd->bhqk', q.astype(dt), k[:, :kv_len].astype(dt)) * scale
  lse = jnp.asarray(lse, dt)
  p = jnp.exp(s - jnp.where(lse == -jnp.inf, jnp.inf, lse)[..., None])
  p = jnp.pad(p, ((0, 0), (0, 0), (0, g * group - lq), (0, 0)))
  return p.reshape(b, h, g, group, kv_len).sum(3)


def _masked_softmax(s, mask):
  """Softmax of the logits s over the last axis where `mask` holds -> (p, lse);
  a row with nothing unmasked gives p = 0 and lse = -inf."""
  m = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True)
  m_safe = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
  p = jnp.where(mask, jnp.exp(s - m_safe), 0)
  l = p.sum(-1, keepdims=True)
  lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1)), -jnp.inf)[..., 0]
  return p / jnp.where(l > 0, l, 1), lse


def gather_rows(x, idx):
  """x [B, N, C], idx [B, k] int -> x[b, idx[b]] [B, k, C]."""
  return jnp.take_along_axis(x, idx[..., None], axis=1)


def scatter_rows(base, rows, idx):
  """base [B, N, C] with rows [B, k, C] written at idx [B, k] (distinct per b)."""
  b = jnp.arange(base.shape[0])[:, None]
  return base.at[b, idx].set(rows.astype(base.dtype))


def dense_column_sums(q, k, v, kv_len: int, scale: float, group: int):
  """Dense attention over the first kv_len keys and the column sums of its probabilities per
  query group (queries [g * group, (g + 1) * group)), materialising the [B, H, Lq, kv_len]
  float32 probabilities: q [B, Lq, H, D], k and v [B, >= kv_len, H, D] -> (out [B, Lq, H, D]
  in q's dtype, sums [B, H, ceil(Lq / group), kv_len] float32)."""
  lq = q.shape[1]
  s = jnp.einsum('bqhd,bkhd->bhqk', q, k[:, :kv_len], preferred_element_type=jnp.float32) * scale
  p = jax.nn.softmax(s, axis=-1)
  out = jnp.einsum('bhqk,bkhd->bqhd', p.astype(v.dtype), v[:, :kv_len],
                   preferred_element_type=jnp.float32).astype(q.dtype)
  member = (jnp.arange(lq)[None] // group == jnp.arange(-(-lq // group))[:, None]).astype(jnp.float32)
  return out, jnp.einsum('gq,bhqk->bhgk', member, p)


def top_k_indices(x, k: int):
  """x [..., N] -> [..., k] int32: lax.top_k's indices (ties to the lower index), sorted."""
  return jnp.sort(lax.top_k(x, k)[1], axis=-1).astype(jnp.int32)
