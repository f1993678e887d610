"""Helpers shared by the parity scripts (ours against the official PyTorch code)."""
from __future__ import annotations

import json
import math

import numpy as np
import torch


def rel_err(got, want) -> float:
  """max |got - want| / max |want|, in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def report(**kw) -> dict:
  """Prints one JSON line per check."""
  print(json.dumps(kw), flush=True)
  return kw


def _mean_std(name: str, p: torch.Tensor, tables: tuple[str, ...]) -> tuple[float, float]:
  """Random but well-scaled: fan-in weights, O(1) tables and gates, norm gains near 1."""
  if name.endswith('scale_mul_1H11'):   # VAR's per-head log temperature
    return math.log(4.0), 0.5
  if name in tables or name.endswith('ada_gss'):
    return 0.0, 0.5
  if p.ndim >= 2:   # Linear [out, in], Conv [out, in, k, k]
    return 0.0, 1.0 / math.sqrt(p[0].numel())
  return (1.0, 0.1) if name.endswith('.weight') else (0.0, 0.1)   # 1-D weights are norm gains


@torch.no_grad()
def randomize_(module: torch.nn.Module, gen: torch.Generator, tables: tuple[str, ...] = ()) -> None:
  """Redraws every parameter (official builders leave some uninitialised or zero)."""
  for name, p in module.named_parameters():
    mean, std = _mean_std(name, p, tables)
    p.copy_(torch.randn(p.shape, generator=gen) * std + mean)
