"""Sampling policies: what a next-scale sampler forwards, caches and attends at each step.

A sampler first binds its policy to the schedule and the model depth (`bind`: a
policy's settings that do not fit them are an error before anything compiles),
then walks the bound policy's *step plan* and, at every step, asks it:
  - `plan`: which scales each step decodes (one, several in one forward, or a
    scale left out, whose f_hat is only carried forward);
  - `select_input`: which of the step's input tokens to forward (the others get
    a zero residual at this step), and `input_counts`, how many of each scale
    (static; they let a step of several scales follow or do such pruning);
  - `block_hooks`: per block, which tokens each sub-layer forwards and how the
    others are restored (see `blocks.BlockHooks`); only forwarded tokens enter
    the KV cache;
  - `attn_mask`: the attention layout of each step;
  - `after_step`: to see f_hat once the step's scales are added to it;
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

  def bind(self, sched: ScaleSchedule, depth: int) -> 'ScalePolicy':
    """The policy for this schedule and model depth (the base needs neither); raises
    ValueError naming the setting that does not fit them."""
    return self

  def plan(self, sched: ScaleSchedule) -> tuple[Step, ...]:
    return tuple(Step((si,)) for si in range(sched.num_scales))

  def init_state(self, sched: ScaleSchedule, batch: int) -> Any:
    return None

  def select_input(self, step_idx: int, step: Step, x: jax.Array, state: Any):
    """Indices [B', k] of the step's input tokens x [B', l, C] to forward, or None for all."""
    return None, state

  def input_counts(self, step: Step) -> Optional[tuple[int, ...]]:
    """How many input tokens of each of the step's scales `select_input` forwards (static; its
    indices then come scale by scale), or None: all of them, or counts it cannot promise."""
    return None

  def after_step(self, step_idx: int, step: Step, f_hat: jax.Array, state: Any) -> Any:
    """The state once the step's scales are added to f_hat [B, H, W, C]."""
    return state

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
