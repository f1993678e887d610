"""MAR's sampling schedule: which tokens each iteration predicts, and the diffusion head's steps.

    schedule = MARSchedule(mask_schedule(cfg.seq_len, num_iter=64), diffusion_steps=100)

`mask_schedule` is the official cosine schedule of `sample_tokens`; `MARSchedule` is the whole
static schedule a MAR sampler runs, what it binds its policy to (`var_models.nn.policy.Binding`);
`merge_sizes` pads an iteration's static row count to one of a few, so that few shapes compile.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

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


def merge_sizes(counts: dict[int, int], most: Optional[int]) -> dict[int, int]:
  """{size: padded size}: the distinct sizes (`counts`: size -> how many iterations have it) in at
  most `most` groups of consecutive sizes, each padded to its group's largest, with the fewest padded
  rows in all (sum of count * padding); None: every size its own."""
  sizes = sorted(counts)
  if most is None or len(sizes) <= most:
    return {n: n for n in sizes}
  waste = lambda i, j: sum(counts[n] * (sizes[j - 1] - n) for n in sizes[i:j])   # sizes[i:j] as one group
  # best[g][j]: (padded rows, group starts) of sizes[:j] in g groups
  best = [[(0, ())] + [(math.inf, ())] * len(sizes)]
  for g in range(1, most + 1):
    best.append([min(((best[g - 1][i][0] + waste(i, j), best[g - 1][i][1] + (i,)) for i in range(j)),
                     default=(math.inf, ())) for j in range(len(sizes) + 1)])
  starts = best[most][len(sizes)][1] + (len(sizes),)
  return {n: sizes[b - 1] for a, b in zip(starts, starts[1:]) for n in sizes[a:b]}


@dataclasses.dataclass(frozen=True)
class MARSchedule:
  """A MAR sampler's whole static schedule: the iterations' token counts and the number of
  (respaced) diffusion steps of the head's sampling loop at every iteration."""
  mask: MaskSchedule
  diffusion_steps: int

  @property
  def num_iter(self) -> int:
    return len(self.mask.n_pred)
