"""Top-k token gather and scatter (FastVAR's pivotal tokens and their restoration).

`topk_gather` keeps the k highest-scoring tokens of x [B, N, C]; `token_scatter`
writes computed rows back into a base [B, N, C] in place (the base's buffer is
the output's, so only the k rows move). The selection itself is `lax.top_k` on
the [B, N] scores; the kernels move the rows, one [rows, cols] tile a program.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch, reference

ROWS = 32      # tokens per program
COLS = 512     # channels per program (fewer when C is smaller)


def _tiles(k: int, c: int):
  cols = min(COLS, pl.next_power_of_2(c))
  return cols, (pl.cdiv(k, ROWS), pl.cdiv(c, cols))


def _tile(t, cb, k, c, cols):
  """Column numbers of a [ROWS, cols] tile, and which of its rows and columns exist."""
  cols_ = cb * cols + jnp.arange(cols)
  return cols_, t * ROWS + jnp.arange(ROWS) < k, cols_ < c


def _gather_kernel(idx_ref, x_ref, o_ref, *, k, c, cols):
  t, cb = pl.program_id(1), pl.program_id(2)
  cols_, rows_ok, cols_ok = _tile(t, cb, k, c, cols)
  both = rows_ok[:, None] & cols_ok[None, :]
  idx = plgpu.load(idx_ref.at[pl.ds(t * ROWS, ROWS)], mask=rows_ok, other=0)
  # Index arrays on both axes (not an array and a slice): the form that both the
  # Triton lowering and interpret mode accept for a gathered access.
  vals = plgpu.load(x_ref.at[idx[:, None], cols_[None, :]], mask=both, other=0)
  plgpu.store(o_ref.at[pl.ds(t * ROWS, ROWS), pl.ds(cb * cols, cols)], vals, mask=both)


def _scatter_kernel(idx_ref, rows_ref, base_ref, o_ref, *, n, k, c, cols):
  del base_ref  # aliased to o_ref: rows not written keep the base's values
  t, cb = pl.program_id(1), pl.program_id(2)
  cols_, rows_ok, cols_ok = _tile(t, cb, k, c, cols)
  both = rows_ok[:, None] & cols_ok[None, :]
  idx = plgpu.load(idx_ref.at[pl.ds(t * ROWS, ROWS)], mask=rows_ok, other=n)
  vals = plgpu.load(rows_ref.at[pl.ds(t * ROWS, ROWS), pl.ds(cb * cols, cols)], mask=both,
                    other=0)
  # Masked-off lanes point past the array (row n): interpret mode drops such
  # writes instead of writing a stale value over a real one.
  plgpu.store(o_ref.at[idx[:, None], cols_[None, :]], vals, mask=both)


def _batch_spec(shape):
  """The whole [...] slab of one batch row of a [B, ...] array."""
  return pl.BlockSpec((pl.squeezed,) + tuple(shape[1:]),
                      lambda b, *_: (b,) + (0,) * (len(shape) - 1))


def _check_rows(x, idx, what):
  if x.ndim != 3 or idx.ndim != 2 or idx.shape[0] != x.shape[0]:
    raise ValueError(f'{what}: expected x [B, N, C] and idx [B, k]; got {x.shape}, {idx.shape}')
  if not jnp.issubdtype(idx.dtype, jnp.integer):
    raise ValueError(f'{what}: indices must be integers, got {idx.dtype}')


def gather_rows(x, idx, *, impl: str = 'auto'):
  """x [B, N, C], idx [B, k] (in [0, N)) -> x[b, idx[b]] [B, k, C]."""
  _check_rows(x, idx, 'gather_rows')
  impl = dispatch.resolve(impl)
  if impl == 'reference':
    return reference.gather_rows(x, idx)
  (b, _, c), k = x.shape, idx.shape[1]
  idx = idx.astype(jnp.int32)
  cols, tiles = _tiles(k, c)
  return pl.pallas_call(
      functools.partial(_gather_kernel, k=k, c=c, cols=cols),
      grid=(b,) + tiles,
      in_specs=[_batch_spec(idx.shape), _batch_spec(x.shape)],
      out_specs=_batch_spec((b, k, c)),
      out_shape=jax.ShapeDtypeStruct((b, k, c), x.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=impl == 'interpret',
      name='gather_rows',
  )(idx, x)


def token_scatter(base, rows, idx, *, impl: str = 'auto'):
  """base [B, N, C] with rows [B, k, C] written at idx [B, k] (distinct per batch row).

  Under jit with `base` donated or computed in the same program, the write is in
  place: only the k rows move.
  """
  _check_rows(base, idx, 'token_scatter')
  if rows.shape != idx.shape + base.shape[2:]:
    raise ValueError(f'token_scatter: rows {rows.shape} do not match idx {idx.shape} and '
                     f'base {base.shape}')
  impl = dispatch.resolve(impl)
  if impl == 'reference':
    return reference.scatter_rows(base, rows, idx)
  (b, _, c), k = base.shape, idx.shape[1]
  idx = idx.astype(jnp.int32)
  cols, tiles = _tiles(k, c)
  return pl.pallas_call(
      functools.partial(_scatter_kernel, n=base.shape[1], k=k, c=c, cols=cols),
      grid=(b,) + tiles,
      in_specs=[_batch_spec(a.shape) for a in (idx, rows, base)],
      out_specs=_batch_spec(base.shape),
      out_shape=jax.ShapeDtypeStruct(base.shape, base.dtype),
      input_output_aliases={2: 0},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=impl == 'interpret',
      name='token_scatter',
  )(idx, rows.astype(base.dtype), base)


def topk_gather(x, scores, k: int, *, impl: str = 'auto'):
  """The k highest-scoring tokens: x [B, N, C], scores [B, N] -> ([B, k, C], idx [B, k] int32).

  Indices come in descending score order (lax.top_k's; ties to the lower index).
  """
  if scores.shape != x.shape[:2]:
    raise ValueError(f'topk_gather: scores {scores.shape} must be x.shape[:2] = {x.shape[:2]}')
  if not 0 < k <= x.shape[1]:
    raise ValueError(f'topk_gather: k must be in [1, {x.shape[1]}], got {k}')
  _, idx = lax.top_k(scores, k)
  return gather_rows(x, idx, impl=impl), idx
