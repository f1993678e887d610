"""Which implementation a kernel call runs: by device, or as asked.

  'auto'      -- on an NVIDIA GPU the Mosaic GPU kernel where the call has one and
                 the GPU is a Hopper, else the Pallas Triton lowering; the
                 plain-jnp reference elsewhere;
  'triton'    -- the Pallas Triton lowering (A100, H100, ...);
  'mosaic'    -- the Pallas Mosaic GPU lowering (Hopper), for the calls that have
                 one (the attention, forward and backward; dense + GELU; the dense
                 layer of stacked weights);
  'interpret' -- the Pallas kernel in interpret mode (CPU tests);
  'reference' -- the plain-jnp reference.
"""
from __future__ import annotations

import contextlib
import functools

import jax

IMPLS = ('auto', 'triton', 'mosaic', 'interpret', 'reference')
_override: list[str] = []


def _on_nvidia_gpu() -> bool:
  device = jax.devices()[0]
  return device.platform == 'gpu' and device.device_kind.lower().startswith('nvidia')


def is_hopper() -> bool:
  """Whether the default device is an NVIDIA GPU of compute capability 9.0 or later."""
  cc = getattr(jax.devices()[0], 'compute_capability', '') if _on_nvidia_gpu() else ''
  return bool(cc) and float(cc) >= 9.0


# Shared memory a CTA may hold on a Hopper GPU (228 KB an SM, 1 KB of it the driver's).
HOPPER_SMEM_BYTES = 227 * 1024
NO_MOSAIC = 'this call has no Mosaic GPU kernel'


def resolve(impl: str, mosaic: str = NO_MOSAIC) -> str:
  """The implementation `impl` runs on the default device. `mosaic`: empty when the
  call has a Mosaic GPU kernel for its shapes, else why not (the error for 'mosaic')."""
  if impl not in IMPLS:
    raise ValueError(f'impl must be one of {IMPLS}, got {impl!r}')
  if impl == 'mosaic' and mosaic:
    raise ValueError(f"impl='mosaic': {mosaic}")
  if impl != 'auto':
    return impl
  if _override:
    return _override[-1]
  if not _on_nvidia_gpu():
    return 'reference'
  return 'mosaic' if not mosaic and is_hopper() else 'triton'


@contextlib.contextmanager
def override(impl: str):
  """Within the block, 'auto' resolves to `impl` (at trace time): e.g. interpret
  mode for the models' `pallas` attention backend in CPU tests."""
  if impl not in IMPLS[1:]:
    raise ValueError(f'override takes one of {IMPLS[1:]}, got {impl!r}')
  _override.append(impl)
  try:
    yield
  finally:
    _override.pop()


def per_shape(*static_argnums: int):
  """A decorator jitting a kernel's call (`pallas_call` and what builds it) with its settings at
  `static_argnums` static: a program's calls of one shape and settings (a model's blocks) trace and
  lower the kernel once, not once a call (XLA inlines the calls)."""
  return functools.partial(jax.jit, static_argnums=static_argnums)
