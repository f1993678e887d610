"""Gathering and scattering tokens by index: the primitive of token-pruning policies.

Plain-jnp versions; `pallas_kernels` provides fused GPU ones with the same contract.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def gather(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x [B, N, C], idx [B, k] int -> [B, k, C]."""
  return jnp.take_along_axis(x, idx[..., None], axis=1)


def scatter(base: jax.Array, idx: jax.Array, y: jax.Array) -> jax.Array:
  """Writes y [B, k, C] into base [B, N, C] at idx [B, k]; other tokens keep base."""
  b = jnp.arange(base.shape[0])[:, None]
  return base.at[b, idx].set(y.astype(base.dtype))
