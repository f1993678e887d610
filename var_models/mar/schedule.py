"""MAR's sampling schedule: which tokens each iteration predicts, and the diffusion head's steps.

    schedule = MARSchedule(mask_schedule(cfg.seq_len, num_iter=64), diffusion_steps=100)

`mask_schedule` is the official cosine schedule of `sample_tokens`; `MARSchedule` is the whole
static schedule a MAR sampler runs, what it binds its policy to (`var_models.nn.policy.Binding`).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class MaskSchedule:
  """Static per-iteration counts of the official cosine schedule (all [num_iter] int)."""
  masked: np.ndarray    # unknown tokens before the iteration
  mask_len: np.ndarray  # unknown tokens after it (as clamped by the official code; >= 1)
  n_pred: np.ndarray    # tokens predicted at the iteration

  @property
  def max_pred(self) -> int:
    return int(self.n_pred.max())


def mask_schedule(seq_len: int, num_iter: int) -> MaskSchedule:
  """The official counts of `num_iter` iterations over `seq_len` tokens; the last one predicts
  every token still unknown."""
  if not 1 <= num_iter <= seq_len:
    raise ValueError(f'num_iter must be in [1, {seq_len}] (the token count), got {num_iter}')
  masked, rows = seq_len, []
  for step in range(num_iter):
    mask_len = int(np.floor(seq_len * np.cos(math.pi / 2.0 * (step + 1) / num_iter)))
    mask_len = max(1, min(masked - 1, mask_len))
    n_pred = masked if step == num_iter - 1 else masked - mask_len
    rows.append((masked, mask_len, n_pred))
    masked -= n_pred
  m, l, n = (np.array(c, np.int32) for c in zip(*rows))
  return MaskSchedule(m, l, n)


@dataclasses.dataclass(frozen=True)
class MARSchedule:
  """A MAR sampler's whole static schedule: the iterations' token counts and the number of
  (respaced) diffusion steps of the head's sampling loop at every iteration."""
  mask: MaskSchedule
  diffusion_steps: int

  @property
  def num_iter(self) -> int:
    return len(self.mask.n_pred)
