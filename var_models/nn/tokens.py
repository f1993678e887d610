"""Gathering and scattering tokens by index: the primitive of token-pruning policies.

Plain-jnp versions; `pallas_kernels` provides fused GPU ones with the same contract.
"""
from __future__ import annotations

from typing import NamedTuple, Union

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


class Rows(NamedTuple):
  """A residual stream [B, N, C] held as `stale` [B, N, C] with its tokens at idx [B, k] (distinct,
  or out of range and dropped) replaced by `rows` [B, k, C]: what a sub-layer that forwarded those
  tokens leaves (`blocks.residual`), so that the next one forwarding the same idx takes `rows` as
  they are, without a scatter into the stream and a gather back out of it."""
  stale: jax.Array
  idx: jax.Array
  rows: jax.Array


def dense(x: Union[jax.Array, Rows]) -> jax.Array:
  """The residual stream x [B, N, C] as one array: a `Rows`'s rows written at their positions."""
  return scatter(x.stale, x.idx, x.rows) if isinstance(x, Rows) else x


def scatter_layer(stack: jax.Array, layer, idx: jax.Array, y: jax.Array) -> jax.Array:
  """Writes y [B, k, ...] into layer `layer` (an int, or traced) of stack [depth, B, N, ...] at
  idx [B, k], as `scatter` on stack[layer]: one scatter into the stack, in place when the stack
  is not read again, rather than a copy of the layer out and back."""
  b = jnp.arange(stack.shape[1])[:, None]
  return stack.at[layer, b, idx].set(y.astype(stack.dtype))
