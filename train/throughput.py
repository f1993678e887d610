"""FLOPs of a step and the device's peak, for images/s and MFU; the devices' memory."""
from __future__ import annotations

from typing import Optional

import jax

# Dense bf16 peak FLOP/s per device (the vendors' figures without sparsity).
PEAK_BF16 = {'H100': 989e12, 'H200': 989e12, 'H800': 989e12, 'A100': 312e12, 'B200': 2250e12,
             'L40S': 362e12, 'A10G': 125e12}


def peak_flops(device: jax.Device, override: float = 0.0) -> Optional[float]:
  """Per-device peak FLOP/s: the override if set, else from the device kind; None if unknown."""
  if override > 0:
    return override
  kind = getattr(device, 'device_kind', '')
  return next((v for k, v in PEAK_BF16.items() if k in kind), None)


def mfu(flops_per_step: Optional[float], steps_per_s: float, peak: Optional[float]) -> Optional[float]:
  if not flops_per_step or not peak:
    return None
  return flops_per_step * steps_per_s / peak


def peak_memory_gib() -> Optional[float]:
  """The highest peak of memory in use on this process's devices, GiB (None where devices keep no
  statistics, as the CPU)."""
  peaks = [(d.memory_stats() or {}).get('peak_bytes_in_use') for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) / 2 ** 30 if peaks else None


def bytes_on_device(tree, device: jax.Device) -> int:
  """Bytes of the arrays of `tree` that live on `device` (its shards: a replicated array counts
  whole, one split over n devices a 1/n part)."""
  return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)
             for shard in leaf.addressable_shards if shard.device == device)
