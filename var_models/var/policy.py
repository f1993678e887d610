"""Sampling policies: what a next-scale sampler forwards, caches and attends at each step.

A sampler walks a *step plan* and, at every step, asks its policy:
  - `plan`: which scales each step decodes (one, several in one forward, or a
    scale left out, whose f_hat is only carried forward);
  - `select_input`: which of the step's input tokens to forward (the others get
    a zero residual at this step);
  - `block_hooks`: per block, which tokens each sub-layer forwards and how the
    others are restored (see `blocks.BlockHooks`); only forwarded tokens enter
    the KV cache;
  - `attn_mask`: the attention layout of each step;
and carries the policy's own `state` (feature caches, index sets) as a pytree.
The accelerators in `accel` subclass `ScalePolicy`. The base class is the
baseline: every token, dense attention, no caches; it adds no operation, so a
baseline sampler compiles to the same program as one without hooks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import numpy as np

from var_models.nn import attention as attn_lib
from var_models.nn.blocks import BlockHooks
from var_models.var.schedules import ScaleSchedule


@dataclasses.dataclass(frozen=True)
class Step:
  """Scales decoded together in one forward pass (ascending)."""
  scales: tuple[int, ...]


class ScalePolicy:
  """The baseline policy."""

  def plan(self, sched: ScaleSchedule) -> tuple[Step, ...]:
    return tuple(Step((si,)) for si in range(sched.num_scales))

  def init_state(self, sched: ScaleSchedule, batch: int) -> Any:
    return None

  def select_input(self, step_idx: int, step: Step, x: jax.Array, state: Any):
    """Indices [B', k] of the step's input tokens x [B', l, C] to forward, or None for all."""
    return None, state

  def block_hooks(self, step_idx: int, step: Step, depth: int) -> Optional[Sequence[Optional[BlockHooks]]]:
    """One `BlockHooks` (or None) per block, or None for plain blocks."""
    return None

  def attn_mask(self, step: Step, q_levels: np.ndarray, k_levels: np.ndarray) -> attn_lib.Mask:
    """Layout of the step's queries over the cached + current keys.

    One scale per step needs no mask: the cache holds only earlier scales.
    """
    if len(step.scales) == 1:
      return None
    return attn_lib.ScaleCausal(q_levels, k_levels)


BASELINE = ScalePolicy()


def check_plan(steps: Sequence[Step], sched: ScaleSchedule) -> None:
  """Steps must cover increasing, distinct scales of the schedule."""
  seen = [si for s in steps for si in s.scales]
  if not seen or any(not 0 <= si < sched.num_scales for si in seen) or seen != sorted(set(seen)):
    raise ValueError(f'invalid step plan {steps} for {sched.num_scales} scales: '
                     'scales must be distinct, increasing and in range')
  if seen[0] != 0:
    raise ValueError(f'step plan {steps} must start with scale 0 (the class token)')
