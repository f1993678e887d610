"""The sampling-policy protocol: what every sampler asks its policy and every accelerator answers.

A sampler (VAR's, MAR's, E-CAR's) is built with a policy. The baseline (this class) computes
everything and adds no operation; an accelerator (`accel/`) overrides some of its answers.

  bind(Binding)         -> the policy for this model and schedule, once, when the sampler is
                           built; a setting that does not fit them raises ValueError naming it
  init_state(batch)     -> the policy's state before the first step, a pytree the sampler
                           carries through every hook (caches, index sets); batch = B samples
  block_hooks(site, n)  -> one `blocks.BlockHooks` (or None) per block of the n-block stack the
                           sampler is about to run at `site`, or None for plain blocks: which
                           tokens each sub-layer forwards, how it attends, how the others are
                           restored
  guide(site, halves, state) -> ((cond, uncond), state): the two halves of a classifier-free-
                           guided quantity at `site`, computed (`halves.both()`) or made by the
                           policy from the conditional half (`halves.cond()`) and its state; the
                           sampler then mixes them with its family's guidance formula

`site` is a static description of where the sampler is, of the family's own type (each family's
policy module documents it); guide's may hold a traced step. Each family adds its own hooks,
explicit in its subclass: VAR's `ScalePolicy` (the step plan, input pruning, attention layout),
MAR's `MARPolicy` (iteration plans, decoder input, the diffusion head's cache), E-CAR's
`StagePolicy` (input pruning and restoring the AR output).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, NamedTuple, Optional, Sequence

import jax

from var_models.nn.blocks import BlockHooks

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Binding:
  """What a sampler binds its policy to."""
  model: Any       # the family's model config: VARConfig, MARConfig, ECARConfig
  schedule: Any    # VAR's ScaleSchedule, MAR's MARSchedule (mar/schedule.py), E-CAR's Euler steps per stage
  guided: bool     # classifier-free guidance: the sampler runs a [cond; uncond] doubled batch
  scanned: bool = False   # runs of alike blocks as one scan: a block's state indexed by a traced layer
  batch: Optional[int] = None   # samples a call (MAR's sampler binds once per batch it is called with)


class Halves(NamedTuple):
  """The two ways a sampler can give a guided quantity's halves; a None one is not available at
  this site (the sampler ran only the conditional half, say)."""
  both: Optional[Callable[[], tuple[Array, Array]]]   # () -> (cond, uncond)
  cond: Optional[Callable[[], Array]]                 # () -> cond


class Policy:
  """The baseline: every token, dense attention, both halves computed, no state."""

  def bind(self, binding: Binding) -> 'Policy':
    return self

  def init_state(self, batch: int) -> Any:
    return None

  def block_hooks(self, site: Hashable, depth: int) -> Optional[Sequence[Optional[BlockHooks]]]:
    return None

  def guide(self, site: Any, halves: Halves, state: Any) -> tuple[tuple[Array, Array], Any]:
    if halves.both is None:
      raise ValueError(f'{type(self).__name__}: only the conditional half was computed at {site!r} and '
                       'the policy does not make the unconditional one: override `guide`')
    return halves.both(), state
