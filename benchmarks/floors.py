"""The memory floor of a sampler: the weight bytes it must read from HBM, over the bandwidth a
device-to-device copy reaches in the same run.

At batch 1 a denoiser step's few rows make every GEMM a pass over its weights, so a sampler cannot
be faster than reading each network's weights (in the compute dtype) once per call of that network.
Activations (a handful of tokens per row) and KV caches are left out: at batch 1 they are under 1 %
of the weights of the workloads here, and at batch 16 the floor is the same weight traffic.
"""
from __future__ import annotations

import statistics
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from timing import call_times


def hbm_bandwidth(nbytes: int = 1 << 31, warmup: int = 3, iters: int = 20) -> float:
  """Bytes per second a device-to-device copy reaches: x + 1 over nbytes of uint32 reads and
  writes each byte once; median of `iters` calls after `warmup`."""
  x = jnp.zeros((nbytes // 4,), jnp.uint32)
  compiled = jax.jit(lambda a: a + 1).lower(x).compile()
  return 2 * nbytes / statistics.median(call_times(compiled, lambda i: (x,), warmup, iters))


def weight_bytes(tree, dtype) -> int:
  """Bytes of every array of `tree` stored in `dtype` (the compute dtype the GEMMs read)."""
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree)) * jnp.dtype(dtype).itemsize


def floor(reads: Mapping[str, tuple[int, int]], bandwidth: float) -> dict:
  """reads {network: (bytes per call, calls)} -> {'seconds', 'bytes', 'reads'}: the time to read
  them all at `bandwidth` bytes/s."""
  total = sum(b * n for b, n in reads.values())
  return {'seconds': total / bandwidth, 'bytes': total, 'reads': dict(reads)}


def describe(f: dict, bandwidth: float) -> str:
  """One line: the floor, its bytes and bandwidth, and each network's share."""
  parts = ', '.join(f'{name} {b / 1e6:.0f} MB x {n}' for name, (b, n) in f['reads'].items())
  return (f"memory floor {f['seconds'] * 1e3:.2f} ms ({f['bytes'] / 1e9:.2f} GB at "
          f"{bandwidth / 1e9:.0f} GB/s: {parts})")
