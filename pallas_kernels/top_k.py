"""Top-k selection in Pallas (Triton lowering): each row's k largest values, as a set of indices.

`lax.top_k` on a GPU sorts every row when k is large (XLA's sort: many passes over
[rows, next power of two of N] value-index pairs), yet SparVAR's CS4A wants a set
(k = 0.2 N keys per query group, in every CS4A block) whose order does not matter. One
program per row holds the row in registers as order-preserving int32 keys, finds the
k-th largest key bit by bit from the top (32 counting passes, no sort), then writes the
indices of the keys above it and of the first keys equal to it: lax.top_k's set (ties
go to the lower index), in increasing index order. Slots come from running sums of the
selection, so the stores need no sort either.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch, reference

MOSAIC = ("top_k_indices has no Mosaic GPU kernel: a row of counting passes and a scatter of "
          "indices is not tensor-core work; impl='auto' runs the Triton lowering on NVIDIA GPUs")
MAX_WIDTH = 1 << 16   # a row lives in registers: 64 K values over 16 warps are 128 per thread


def order_keys(x):
  """float32 -> int32 keys with the same order (-0.0 just below +0.0; NaNs not allowed)."""
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _kernel(x_ref, o_ref, *, n: int, k: int, width: int):
  cols = jnp.arange(width)
  valid = cols < n
  key = order_keys(plgpu.load(x_ref.at[pl.ds(0, width)], mask=valid, other=0.0))
  count = lambda t: jnp.sum((valid & (key >= t)).astype(jnp.int32))
  # The k-th largest key t is the largest with count(t) >= k: its sign first, then its
  # other 31 bits from the highest (with the sign fixed, signed order is bit order). Bits
  # are set by shifts of the counts' outcomes: the Triton lowering mistypes a select of
  # scalars.
  t = -(count(0) < k).astype(jnp.int32) << 31
  for bit in range(30, -1, -1):
    t = t | ((count(t | (1 << bit)) >= k).astype(jnp.int32) << bit)
  above = valid & (key > t)
  tied = valid & (key == t)
  ties_taken = k - jnp.sum(above.astype(jnp.int32))
  take = above | (tied & (jnp.cumsum(tied.astype(jnp.int32)) <= ties_taken))
  slot = jnp.cumsum(take.astype(jnp.int32)) - 1
  # Lanes not taken point at slot k (past the output): interpret mode drops those writes.
  plgpu.store(o_ref.at[jnp.where(take, slot, k)], cols, mask=take)


@dispatch.per_shape(1, 2, 3)
def _select(x, k: int, interpret: bool, num_warps: int):
  rows, n = x.shape
  width = pl.next_power_of_2(n)
  return pl.pallas_call(
      functools.partial(_kernel, n=n, k=k, width=width),
      grid=(rows,),
      in_specs=[pl.BlockSpec((pl.squeezed, n), lambda r: (r, 0))],
      out_specs=pl.BlockSpec((pl.squeezed, k), lambda r: (r, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, k), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name='top_k_indices',
  )(x)


def top_k_indices(x, k: int, *, impl: str = 'auto', num_warps: Optional[int] = None):
  """x [..., N] float (no NaNs) -> [..., k] int32: the indices of each row's k largest values
  (lax.top_k's set: of equal values the lower indices), in increasing index order.
  `impl`: see `pallas_kernels.dispatch` (no 'mosaic': see MOSAIC). `num_warps` (Triton's)
  defaults to one thread per 16 of the row's values, 4 to 16 warps."""
  if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f'top_k_indices: x must be a float array [..., N], got {x.dtype} {x.shape}')
  n = x.shape[-1]
  if not 1 <= k <= n:
    raise ValueError(f'top_k_indices: k={k} must be in [1, N = {n}] for x {x.shape}')
  if n > MAX_WIDTH:
    raise ValueError(f'top_k_indices: rows of N = {n} > {MAX_WIDTH} values do not fit one program')
  impl = dispatch.resolve(impl, MOSAIC)
  if impl == 'reference':
    return reference.top_k_indices(x, k)
  warps = min(16, max(4, pl.next_power_of_2(n) // 512)) if num_warps is None else num_warps
  out = _select(x.reshape(-1, n), k, impl == 'interpret', warps)
  return out.reshape(x.shape[:-1] + (k,))
