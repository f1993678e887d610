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
  """Writes y [B, k, ...] into base [B, N, ...] at idx [B, k]; other tokens keep base (positions
  out of range are dropped)."""
  b = jnp.arange(base.shape[0])[:, None]
  return base.at[b, idx].set(y.astype(base.dtype))


def scatter_add(base: jax.Array, idx: jax.Array, y: jax.Array) -> jax.Array:
  """base [B, N, C] with y [B, k, C] added at idx [B, k] (distinct, or out of range and dropped),
  in their promoted dtype: base + scatter(zeros, idx, y) without the zeros, in place when base is
  not read again."""
  dtype = jnp.result_type(base, y)
  b = jnp.arange(base.shape[0])[:, None]
  return base.astype(dtype).at[b, idx].add(y.astype(dtype))


def scatter_layer(stack: jax.Array, layer, idx: jax.Array, y: jax.Array) -> jax.Array:
  """Writes y [B, k, ...] into layer `layer` (an int, or traced) of stack [depth, B, N, ...] at
  idx [B, k], as `scatter` on stack[layer]: one scatter into the stack, in place when the stack
  is not read again, rather than a copy of the layer out and back."""
  b = jnp.arange(stack.shape[1])[:, None]
  return stack.at[layer, b, idx].set(y.astype(stack.dtype))
