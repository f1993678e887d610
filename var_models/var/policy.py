"""VAR's sampling policies: the core `var_models.nn.policy.Policy` and the next-scale family's extensions.

The sampler binds its policy once, when built (`bind(Binding)`: binding.model is the `VARConfig`,
binding.schedule its `ScaleSchedule`, binding.guided True: the batch is always doubled for
CFG; settings that do not fit them are an error before anything compiles), takes its state
(`init_state(B)`, B the samples, not the doubled rows) and walks the bound policy's *step plan*.
The hooks of a step (`block_hooks`, `select_input`, `after_step`) take its static `Site(index,
step)`: the step and its position in the plan; `guide`'s site is a scale's index. The core hooks:
  - `block_hooks(site, depth)`: per block, which tokens each sub-layer forwards and how the
    others are restored (see `blocks.BlockHooks`); only forwarded tokens enter the KV cache;
  - `guide(si, halves, state)`: the conditional and unconditional logits [B, l_si, V] of scale
    si (an int, the scale's index in the schedule), which the sampler mixes as
    (1 + t) * cond - t * uncond; the baseline takes both halves of the doubled batch.
The family's extensions:
  - `plan`: which scales each step decodes (one, several in one forward, or a scale left out,
    whose f_hat is only carried forward);
  - `select_input`: which of the step's input tokens to forward (the others get a zero
    residual at this step), and `input_counts`, how many of each scale (static; they let a
    step of several scales follow or do such pruning);
  - `attn_mask`: the attention layout of each step;
  - `after_step`: to see f_hat once the step's scales are added to it.
The policy's own `state` (feature caches, index sets) is a pytree carried through every hook.
The accelerators in `accel` subclass `ScalePolicy`. The base class is the baseline: every
token, dense attention, both halves, no caches; it adds no operation, so a baseline sampler
compiles to the same program as one without hooks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np

from var_models.nn import attention as attn_lib
from var_models.nn.blocks import BlockHooks
from var_models.nn.policy import Binding, Policy
from var_models.var.model import VARConfig
from var_models.var.schedules import ScaleSchedule


@dataclasses.dataclass(frozen=True)
class Step:
  """Scales decoded together in one forward pass (ascending)."""
  scales: tuple[int, ...]


class Site(NamedTuple):
  """Where the sampler is: the step at position `index` of the plan (static, hashable)."""
  index: int
  step: Step


def var_binding(var_cfg: VARConfig, scanned: bool = False) -> Binding:
  """What the sampler of var_cfg binds its policy to: the config, its schedule,
  guided (VAR doubles the batch for CFG), and whether its blocks run as scans."""
  return Binding(model=var_cfg, schedule=var_cfg.schedule, guided=True, scanned=scanned)


class ScalePolicy(Policy):
  """The baseline policy."""

  def plan(self, sched: ScaleSchedule) -> tuple[Step, ...]:
    return tuple(Step((si,)) for si in range(sched.num_scales))

  def select_input(self, site: Site, x: jax.Array, state: Any):
    """Indices [2B, k] of the step's input tokens x [2B, l, C] to forward, or None for all."""
    return None, state

  def input_counts(self, step: Step) -> Optional[tuple[int, ...]]:
    """How many input tokens of each of the step's scales `select_input` forwards (static; its
    indices then come scale by scale), or None: all of them, or counts it cannot promise."""
    return None

  def after_step(self, site: Site, f_hat: jax.Array, state: Any) -> Any:
    """The state once the step's scales are added to f_hat [B, H, W, C]."""
    return state

  def block_hooks(self, site: Site, depth: int) -> Optional[Sequence[Optional[BlockHooks]]]:
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
