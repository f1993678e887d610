"""Sampling policies of MAR: what each iteration computes, forwards and caches.

The MAR sampler first binds its policy to the model, the iteration count, the guidance and
the head's step count (`bind`: settings that do not fit them are an error before anything
compiles), runs its iterations as one `lax.scan` whose body switches between the distinct
static *plans*, and at every iteration asks its policy:
  - `plan`: one `IterPlan` per iteration: whether the unconditional half of the
    CFG batch runs, and a static tag of the policy's own (say, how many tokens the
    decoder forwards); equal plans share one compiled branch of the scan body;
  - `begin`: to note the iteration's facts (which tokens are still unknown, which
    ones it predicts) in the policy's state;
  - `encoder_hooks` / `decoder_hooks`: per block, which tokens each sub-layer
    forwards, which keys and values they attend to (`BlockHooks.kv`: the cached
    K/V of the others) and how the others are restored (cached features);
  - `decoder_input`: the decoder's input to run (e.g. cached rows where the
    encoder output did not change);
  - `guidance`: the unconditional half of the decoder blocks' output (before the
    decoder norm) when the plan skips it (e.g. cond + a cached uncond - cond
    delta), and what a full iteration leaves in the cache;
  - `head_cache`: a `diffloss.HeadCache` for the iteration's DiffLoss sampling
    loop (per-step kinds, res-block hooks, guidance from cached deltas), or None;
  - `record`: the iteration's caching decisions, stacked into the sampler's
    aux['iterations'] when it is made with record=True;
and carries the policy's `state` (its caches) through the scan as a pytree.
LazyMAR (`accel`) subclasses `MARPolicy`. The base class is the baseline: every
token, both halves, no caches; it adds no operation, so a baseline sampler
compiles to the program of a sampler without hooks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Optional, Sequence

import jax

from var_models.mar.diffloss import HeadCache
from var_models.nn.blocks import BlockHooks

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class IterPlan:
  """Static choices of one MAR iteration."""
  uncond: bool = True      # run the CFG batch's unconditional half (else `guidance` makes it)
  tag: Hashable = None     # the policy's own static choice for the iteration


@dataclasses.dataclass(frozen=True)
class IterInfo:
  """What an iteration knows when it starts (traced arrays)."""
  step: Array        # [] int32, the iteration's index
  mask: Array        # [B, N] bool, True where the token is still unknown
  pred_idx: Array    # [B, P] int32, the positions predicted now, padded with N


class MARPolicy:
  """The baseline policy."""

  def bind(self, cfg: Any, num_iter: int, guided: bool, diffusion_steps: int) -> 'MARPolicy':
    """The policy for this `MARConfig`, iteration count, guidance and head step count (the base
    needs none); raises ValueError naming the setting that does not fit them."""
    return self

  def plan(self, num_iter: int) -> tuple[IterPlan, ...]:
    return (IterPlan(),) * num_iter

  def init_state(self, batch: int, guided: bool) -> Any:
    """The state before the first iteration; `batch` samples (rows are doubled with CFG)."""
    return None

  def begin(self, plan: IterPlan, info: IterInfo, state: Any) -> Any:
    return state

  def encoder_hooks(self, plan: IterPlan, depth: int) -> Optional[Sequence[Optional[BlockHooks]]]:
    """One `BlockHooks` (or None) per encoder block, or None for plain blocks."""
    return None

  def decoder_hooks(self, plan: IterPlan, depth: int) -> Optional[Sequence[Optional[BlockHooks]]]:
    """One `BlockHooks` (or None) per decoder block, or None for plain blocks."""
    return None

  def decoder_input(self, plan: IterPlan, x: Array, state: Any) -> tuple[Array, Any]:
    """The decoder input to run [rows, buffer + N, Cd] from the fresh one x."""
    return x, state

  def guidance(self, plan: IterPlan, x: Array, state: Any) -> tuple[Array, Any]:
    """The decoder blocks' output (before the decoder norm) of both CFG halves [2B, buffer + N,
    Cd] from x: [2B, ...] when the plan ran both halves, [B, ...] (conditional) when it skipped
    the unconditional one."""
    if not plan.uncond:
      raise NotImplementedError(f'{type(self).__name__} skips the unconditional half but does not '
                                'say how to make it: override `guidance`')
    return x, state

  def head_cache(self, plan: IterPlan) -> Optional[HeadCache]:
    """The DiffLoss sampling loop's cache at this iteration (guided samplers only), or None."""
    return None

  def record(self, plan: IterPlan, state: Any) -> dict:
    """The iteration's caching decisions {name: array}, the same keys and shapes at every plan."""
    return {}


BASELINE = MARPolicy()


def check_plans(plans: Sequence[IterPlan], num_iter: int) -> None:
  if len(plans) != num_iter or not all(isinstance(p, IterPlan) for p in plans):
    raise ValueError(f'a MAR policy plan must hold one IterPlan per iteration ({num_iter}), got {plans!r}')
