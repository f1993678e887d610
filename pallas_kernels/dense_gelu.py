"""Dense layer + tanh-GELU, a transformer MLP's first half, as one GEMM on Hopper.

`dense_gelu(x, w, b)` = jax.nn.gelu(x @ w + b, approximate=True) for x [..., K],
w [K, N], b [N]. On a Hopper GPU ('auto') the Mosaic GPU kernel of
`dense_gelu_mgpu` computes it without writing the pre-activation; elsewhere, and
for shapes that kernel does not take, XLA computes the reference (the GEMM, then
the bias and the GELU in x's dtype, exactly as flax's Dense + jax.nn.gelu).
`var_models.nn.blocks.FFN` calls it at inference; NOTES.md has the measurements.
"""
from __future__ import annotations

import jax

from pallas_kernels import dense_gelu_mgpu, dispatch

# 'auto' leaves GEMMs of fewer rows to XLA: measured in VAR-d30's sampler from 8192 rows up;
# below that not measured, and each further shape costs compile time (NOTES.md).
AUTO_MIN_ROWS = 8192


def pays(rows: int) -> bool:
  """Whether 'auto' picks the kernel (where the GPU has it) for a GEMM of `rows` rows."""
  return rows >= AUTO_MIN_ROWS


def reference(x, w, b):
  """jax.nn.gelu(x @ w + b, approximate=True): [..., K] x [K, N] + [N] -> [..., N]."""
  return jax.nn.gelu(x @ w + b, approximate=True)


@jax.custom_vjp
def _fused(x, w, b):
  return dense_gelu_mgpu.dense_gelu(x, w, b)


def _fused_fwd(x, w, b):
  return _fused(x, w, b), (x, w, b)


def _fused_bwd(res, g):
  # Recomputes the pre-activation: for training, the reference (which keeps it) is cheaper.
  return jax.vjp(reference, *res)[1](g)


_fused.defvjp(_fused_fwd, _fused_bwd)


def dense_gelu(x: jax.Array, w: jax.Array, b: jax.Array, *, impl: str = 'auto') -> jax.Array:
  """gelu_tanh(x @ w + b): x [..., K], w [K, N], b [N] -> [..., N] in x's dtype.

  `impl`: 'auto' (the Mosaic GPU kernel on Hopper where `dense_gelu_mgpu.unsupported`
  allows and x has at least AUTO_MIN_ROWS rows, else the reference), 'mosaic' or
  'reference'; there is no Triton kernel.
  """
  if x.shape[-1] != w.shape[0] or b.shape != (w.shape[1],):
    raise ValueError(f'dense_gelu expects x [..., K], w [K, N], b [N]; got {x.shape}, {w.shape}, {b.shape}')
  if impl in ('triton', 'interpret'):
    raise ValueError(f"dense_gelu has no {impl!r} kernel: use 'auto', 'mosaic' or 'reference'")
  x2 = x.reshape(-1, x.shape[-1])
  if impl == 'auto' and not pays(x2.shape[0]):
    impl = 'reference'
  if dispatch.resolve(impl, dense_gelu_mgpu.unsupported(x2, w)) != 'mosaic':
    return reference(x, w, b)
  return _fused(x2, w, b).reshape(*x.shape[:-1], w.shape[1])
