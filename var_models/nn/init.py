"""Random parameters drawn by one compiled program that compiles in seconds on a GPU.

On a GPU, JAX lowers each threefry draw to its rounds written out as HLO, and XLA's passes over a
model's hundreds of draws take minutes: MAR-H's and KL-16's initialiser compiled in 99.9 s on an
H200, in 10.0 s with JAX's other lowering, one threefry kernel a draw, which computes the same
bits (benchmarks/random_init.py; benchmarks/RESULTS.md, "random parameters in seconds").
`compiled_init` compiles an initialiser that way; a CPU lowers threefry as a loop either way. The
samplers keep the rounds, which fuse into their steps' kernels (kernels there: up to 1.4x slower).

Only programs whose draws are whole on every device take it (one device, or a replicated train
state: `train.state.sharded_init`): XLA's SPMD partitioner does not split a custom kernel, and
would draw a tree split over FSDP whole on every device.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import jax

_FLAG = 'jax_threefry_gpu_kernel_lowering'


@contextlib.contextmanager
def threefry_kernels() -> Iterator[None]:
  """Within the block, programs lowered for a GPU draw their threefry bits with one kernel per draw
  (JAX's `jax_threefry_gpu_kernel_lowering`, set for the process and restored on exit)."""
  before = getattr(jax.config, _FLAG)
  jax.config.update(_FLAG, True)
  try:
    yield
  finally:
    jax.config.update(_FLAG, before)


def compiled_init(init: Callable[[jax.Array], Any], key: jax.Array) -> Any:
  """init(key) -> params, compiled as one program (op by op, a transformer's initialisers are
  hundreds of small compiles) whose draws are threefry kernels on a GPU (`threefry_kernels`)."""
  with threefry_kernels():
    return jax.jit(init)(key)
