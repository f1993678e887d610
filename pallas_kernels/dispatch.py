"""Which implementation a kernel call runs: by device, or as asked.

  'auto'      -- the Pallas Triton lowering on an NVIDIA GPU, the plain-jnp
                 reference elsewhere;
  'triton'    -- the Pallas Triton lowering (A100, H100, ...);
  'interpret' -- the Pallas kernel in interpret mode (CPU tests);
  'reference' -- the plain-jnp reference.
"""
from __future__ import annotations

import contextlib

import jax

IMPLS = ('auto', 'triton', 'interpret', 'reference')
_override: list[str] = []


def _on_nvidia_gpu() -> bool:
  device = jax.devices()[0]
  return device.platform == 'gpu' and device.device_kind.lower().startswith('nvidia')


def is_hopper() -> bool:
  """Whether the default device is an NVIDIA GPU of compute capability 9.0 or later."""
  cc = getattr(jax.devices()[0], 'compute_capability', '') if _on_nvidia_gpu() else ''
  return bool(cc) and float(cc) >= 9.0


def resolve(impl: str) -> str:
  """The implementation `impl` runs on the default device."""
  if impl not in IMPLS:
    raise ValueError(f'impl must be one of {IMPLS}, got {impl!r}')
  if impl != 'auto':
    return impl
  if _override:
    return _override[-1]
  return 'triton' if _on_nvidia_gpu() else 'reference'


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
