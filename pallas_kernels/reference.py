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


def diffloss_blocks(x, mods, w1, b1, w2, b2, ln_scale, ln_bias, eps: float = 1e-6):
  """MAR's DiffLoss res blocks: for each block i of D, x + gate * (SiLU((LN(x) * (1 + scale)) @
  w1[i] + b1[i] + shift_w) @ w2[i] + b2[i]), (shift_w, scale, gate) the i-th [R, 3C] of mods, as
  the head's merged adaLN output gives them (shift_w: the shift through w1[i]). x [R, C], mods
  [R, >= 3 D C], w1, w2 [D, C, C], b1, b2, ln_scale, ln_bias [D, C] -> [R, C] in x's dtype."""
  dt = jnp.promote_types(x.dtype, jnp.float32)
  h = x.astype(dt)
  c = h.shape[-1]
  for i in range(w1.shape[0]):
    shift_w, scale, gate = jnp.split(mods[:, 3 * i * c:3 * (i + 1) * c].astype(dt), 3, axis=-1)
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    y = (h - mean) * lax.rsqrt(var + eps) * ln_scale[i] + ln_bias[i]
    y = jax.nn.silu((y * (1 + scale)) @ w1[i].astype(dt) + b1[i] + shift_w) @ w2[i].astype(dt) + b2[i]
    h = h + gate * y
  return h.astype(x.dtype)


def diffloss_blocks_inputs(rows: int, width: int, depth: int, seed: int = 0, weights=jnp.bfloat16):
  """Random arguments of `diffloss_blocks` at DiffLoss's scales (unit rows, adaLN outputs of 0.3,
  Dense kernels of 1 / sqrt(width) in `weights`), for the kernel's tests and benchmark: x [R, C],
  mods [R, 3 D C + 2 C] (the merged adaLN output with the final layer's columns), w1, b1, w2, b2,
  ln_scale, ln_bias."""
  ks = jax.random.split(jax.random.key(seed), 8)
  normal = lambda k, shape, scale: jax.random.normal(k, shape, jnp.float32) * scale
  kernel = lambda k: normal(k, (depth, width, width), width ** -0.5).astype(weights)
  vector = lambda k: normal(k, (depth, width), 0.1)
  return (normal(ks[0], (rows, width), 1.0), normal(ks[1], (rows, 3 * depth * width + 2 * width), 0.3),
          kernel(ks[2]), vector(ks[3]), kernel(ks[4]), vector(ks[5]), 1.0 + vector(ks[6]), vector(ks[7]))
