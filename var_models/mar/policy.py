"""Sampling policies of MAR: what each iteration computes, forwards and caches.

`MARPolicy` is the core `var_models.nn.policy.Policy` as MAR asks it. The MAR sampler binds its
policy when it is built, to `Binding(model=MARConfig, schedule=MARSchedule (mar/schedule.py: the
mask schedule and the head's diffusion step count), guided=the CFG flag)`, and again for each batch
size it is called with (`batch` set; the plans may depend on it) (settings that do not fit them are
an error before anything compiles), runs its iterations as
one `lax.scan` whose body switches between the distinct static *plans* for the model part and
between the distinct head caches for the diffusion head, and carries the policy's state (its
caches, a pytree; `init_state(batch)`, batch = B samples) through the scan. At every iteration it
asks the core hooks:
  - `block_hooks(Site(plan, stack), depth)`: per block of the encoder or decoder stack, which
    tokens each sub-layer forwards, which keys and values they attend to (`BlockHooks.kv`:
    the cached K/V of the others) and how the others are restored (cached features);
  - `guide(plan, halves, state)` (guided samplers): the decoder blocks' output (before the
    decoder norm) of the conditional and unconditional halves, each [B, buffer + N, Cd]:
    `halves.both()` when the plan ran both halves, else made from `halves.cond()` and the
    state (e.g. cond + a cached uncond - cond delta); the site is the iteration's `IterPlan`;
and MAR's extensions:
  - `plan(num_iter)`: one `IterPlan` per iteration of the bound schedule: whether the
    unconditional half of the CFG batch runs, and a static tag of the policy's own (say, how
    many tokens the decoder forwards); equal plans share one compiled branch of the scan body;
  - `begin`: to note the iteration's facts (which tokens are still unknown, which ones it
    predicts) in the policy's state;
  - `decoder_input`: the decoder's input to run (e.g. cached rows where the encoder output
    did not change);
  - `head_cache`: a `diffloss.HeadCache` for the iteration's DiffLoss sampling loop (per-step
    kinds, res-block hooks, guidance from cached deltas), or None; asked once per plan when the
    sampler is made, and equal caches (hashable, compared by value) share one compiled loop;
  - `end`: to close the iteration's model part (keep what the next one needs, drop the
    iteration's scratch values: the state has the same structure at every iteration); the head
    then samples its tokens;
  - `record`: the iteration's caching decisions, stacked into the sampler's aux['iterations']
    when it is made with record=True.
LazyMAR (`accel`) subclasses `MARPolicy`. The base class is the baseline: every token, both
halves, no caches, no state; it adds no operation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Hashable, NamedTuple, Optional, Sequence

import jax

from var_models.mar.diffloss import HeadCache
from var_models.nn.policy import Policy

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class IterPlan:
  """Static choices of one MAR iteration."""
  uncond: bool = True      # run the CFG batch's unconditional half (else `guide` makes it)
  tag: Hashable = None     # the policy's own static choice for the iteration
  # The encoder's rows: every position, the unknown ones hidden as keys (True; a policy whose
  # encoder hooks cache per position asks for it); else the buffer and the known positions
  # gathered, padded to a static length.
  every_position: bool = False


class Site(NamedTuple):
  """Where `block_hooks` is asked: the iteration's plan and the stack about to run."""
  plan: IterPlan
  stack: str               # 'encoder' or 'decoder'


@dataclasses.dataclass(frozen=True)
class IterInfo:
  """What an iteration knows when it starts (traced arrays)."""
  step: Array        # [] int32, the iteration's index
  mask: Array        # [B, N] bool, True where the token is still unknown
  pred_idx: Array    # [B, P] int32, the positions predicted now, padded with N


class MARPolicy(Policy):
  """The baseline policy (see the module docstring for what the sampler asks)."""

  def plan(self, num_iter: int) -> tuple[IterPlan, ...]:
    """One plan per iteration; num_iter is the bound schedule's."""
    return (IterPlan(),) * num_iter

  def begin(self, plan: IterPlan, info: IterInfo, state: Any) -> Any:
    return state

  def decoder_input(self, plan: IterPlan, x: Array, state: Any) -> tuple[Array, Any]:
    """The decoder input to run [rows, buffer + N, Cd] from the fresh one x (rows = 2B when the
    plan runs both CFG halves, else B)."""
    return x, state

  def head_cache(self, plan: IterPlan) -> Optional[HeadCache]:
    """The DiffLoss sampling loop's cache at this iteration (guided samplers only), or None."""
    return None

  def end(self, plan: IterPlan, state: Any) -> Any:
    """The state the next iteration starts from, once this one's model part has run."""
    return state

  def record(self, plan: IterPlan, state: Any) -> dict:
    """The iteration's caching decisions {name: array}, the same keys and shapes at every plan."""
    return {}


BASELINE = MARPolicy()


def check_plans(plans: Sequence[IterPlan], num_iter: int) -> None:
  if len(plans) != num_iter or not all(isinstance(p, IterPlan) for p in plans):
    raise ValueError(f'a MAR policy plan must hold one IterPlan per iteration ({num_iter}), got {plans!r}')
