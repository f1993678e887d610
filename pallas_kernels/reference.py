"""Plain-jnp references of the kernels: the CPU fallback and the tests' ground truth.

They compute in the promoted dtype of their inputs with float32 at least, so a
float64 call (under `jax.enable_x64`) is the float64 reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_attention(q, k, v, mask, scale: float):
  """Softmax attention under a token mask, empty query rows giving zeros.

  q [B, Lq, H, D], k and v [B, Lk, H, D], mask [Hm, Lq, Lk] bool (Hm = 1 or H)
  -> (out [B, Lq, H, D] in q's dtype, lse [B, H, Lq]; -inf on empty rows).
  """
  dt = jnp.promote_types(q.dtype, jnp.float32)
  s = jnp.einsum('bqhd,bkhd->bhqk', q.astype(dt), k.astype(dt)) * scale
  mask = jnp.asarray(mask)[None]
  m = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True)
  m_safe = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
  p = jnp.where(mask, jnp.exp(s - m_safe), 0)
  l = p.sum(-1, keepdims=True)
  o = jnp.einsum('bhqk,bkhd->bqhd', p / jnp.where(l > 0, l, 1), v.astype(dt))
  lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1)), -jnp.inf)[..., 0]
  return o.astype(q.dtype), lse


def gather_rows(x, idx):
  """x [B, N, C], idx [B, k] int -> x[b, idx[b]] [B, k, C]."""
  return jnp.take_along_axis(x, idx[..., None], axis=1)


def scatter_rows(base, rows, idx):
  """base [B, N, C] with rows [B, k, C] written at idx [B, k] (distinct per b)."""
  b = jnp.arange(base.shape[0])[:, None]
  return base.at[b, idx].set(rows.astype(base.dtype))


def pts_scores(x):
  """FastVAR's pivotal-token score ||x_i - mean_j x_j||^2: x [B, N, C] -> [B, N] float32."""
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return jnp.sum(jnp.square(x - x.mean(1, keepdims=True)), -1)
