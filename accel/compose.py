"""`compose(a, b, ...)`: several accelerators in one next-scale (VAR) sampler.

Only VAR has several accelerators (FastVAR, LazyVAR, SparVAR); MAR's and E-CAR's policies are
refused, naming their family. The composite asks every policy at every hook and combines the
answers where that has one meaning, and raises ValueError (before compiling, or while tracing
for per-step answers) where it has none:
  - plan: policies that keep the baseline's plan follow the other's; plans of one scale per
    step that differ only in skipped trailing scales give the shorter (a scale runs only if
    every policy runs it); any other pair of different plans is an error;
  - state: a tuple, one slot per policy, each policy seeing only its own;
  - select_input: at most one policy may drop input tokens at a step (its `input_counts`
    are the composite's); `after_step` reaches every policy;
  - block hooks: at most one policy may select a sub-layer's tokens (`BlockHooks.selects`, a
    static answer); its `restore` fills in the others, then every other policy's `restore`
    sees the full output (idx None), so a policy that caches outputs (FastVAR's cache scale)
    still can; at most one policy may compute a block's attention (`attend`, SparVAR's);
  - attn_mask: the first policy that overrides the baseline's;
  - guide: at most one policy may make the guided halves (override `guide`), on its own
    slot; the others' guide is the baseline's, which only computes both halves, so they
    need not see it.
"""
from __future__ import annotations

from typing import Any, Optional

import jax

from ecar.policy import StagePolicy
from var_models.mar.policy import MARPolicy
from var_models.nn.blocks import BlockHooks
from var_models.nn.policy import Binding, Halves, Policy
from var_models.var.policy import ScalePolicy, Site, Step
from var_models.var.schedules import ScaleSchedule

Array = jax.Array
OTHER_FAMILIES = ((MARPolicy, 'a MAR policy'), (StagePolicy, 'an E-CAR policy'))


def _one_scale_prefix(plan: tuple[Step, ...]) -> bool:
  return all(s.scales == (i,) for i, s in enumerate(plan))


def merge_plans(plans: list[tuple[Step, ...]], sched: ScaleSchedule) -> tuple[Step, ...]:
  """The composite's plan (see the module docstring)."""
  baseline = ScalePolicy().plan(sched)
  changed = [p for p in plans if p != baseline]
  if not changed:
    return baseline
  if all(_one_scale_prefix(p) for p in changed):
    return min(changed, key=len)
  if any(p != changed[0] for p in changed):
    raise ValueError(f'compose: the policies plan the steps differently: {changed}')
  return changed[0]


def _with_slot(state: tuple, slot: int, value: Any) -> tuple:
  return state[:slot] + (value,) + state[slot + 1:]


class ComposedHooks(BlockHooks):
  """One block's hooks of several policies, each on its own slot of the composite state."""

  def __init__(self, hooks: list[tuple[int, BlockHooks]]):
    self.hooks = hooks

  def selects(self, site: str) -> bool:
    return self._selector(site) is not None

  def _selector(self, site: str) -> Optional[int]:
    """The slot of the policy that selects the tokens of `site`, if any."""
    slots = [slot for slot, h in self.hooks if h.selects(site)]
    if len(slots) > 1:
      raise ValueError(f'compose: two policies select the tokens of sub-layer {site!r} of one block')
    return slots[0] if slots else None

  def select(self, site: str, x: Array, state: tuple):
    chosen, selector = None, self._selector(site)
    for slot, h in self.hooks:
      idx, sub = h.select(site, x, state[slot])
      state = _with_slot(state, slot, sub)
      if (idx is not None) != (slot == selector):
        raise ValueError(f'{type(h).__name__}.selects({site!r}) does not say what its `select` does')
      chosen = idx if slot == selector else chosen
    return chosen, state

  def attend(self, q, k, v, *, mask, kv_len, scale, backend, state: tuple):
    own = [(slot, h) for slot, h in self.hooks if type(h).attend is not BlockHooks.attend]
    if len(own) > 1:
      raise ValueError('compose: two policies compute the attention of one block')
    if not own:
      return super().attend(q, k, v, mask=mask, kv_len=kv_len, scale=scale, backend=backend, state=state)
    slot, h = own[0]
    out, sub = h.attend(q, k, v, mask=mask, kv_len=kv_len, scale=scale, backend=backend, state=state[slot])
    return out, _with_slot(state, slot, sub)

  def restore(self, site: str, y: Array, idx: Optional[Array], x: Array, state: tuple):
    first = self._selector(site)
    order = sorted(self.hooks, key=lambda sh: sh[0] != first)
    for slot, h in order:
      y, sub = h.restore(site, y, idx if slot == first else None, x, state[slot])
      state = _with_slot(state, slot, sub)
    return y, state


def _guides(policy: ScalePolicy) -> bool:
  """Whether the policy makes the guided halves itself (overrides the core's `guide`)."""
  if isinstance(policy, Composed):
    return policy.guider is not None
  return type(policy).guide is not Policy.guide


class Composed(ScalePolicy):
  """The policy `compose` returns; `guider` is the slot of the one policy that overrides `guide`,
  or None."""

  def __init__(self, policies: tuple[ScalePolicy, ...]):
    self.policies = policies
    guiders = [slot for slot, p in enumerate(policies) if _guides(p)]
    if len(guiders) > 1:
      names = ', '.join(type(policies[slot]).__name__ for slot in guiders)
      raise ValueError(f'compose: at most one policy may make the guided halves (override `guide`); {names} do')
    self.guider = guiders[0] if guiders else None

  def bind(self, binding: Binding) -> 'Composed':
    return Composed(tuple(p.bind(binding) for p in self.policies))

  def plan(self, sched: ScaleSchedule) -> tuple[Step, ...]:
    return merge_plans([p.plan(sched) for p in self.policies], sched)

  def init_state(self, batch: int) -> tuple:
    return tuple(p.init_state(batch) for p in self.policies)

  def select_input(self, site: Site, x: Array, state: tuple):
    chosen = None
    for slot, p in enumerate(self.policies):
      sel, sub = p.select_input(site, x, state[slot])
      state = _with_slot(state, slot, sub)
      if sel is not None:
        if chosen is not None:
          raise ValueError(f'compose: two policies select the input tokens of step {site.step}')
        chosen = sel
    return chosen, state

  def input_counts(self, step: Step):
    counts = [c for c in (p.input_counts(step) for p in self.policies) if c is not None]
    return counts[0] if counts else None

  def after_step(self, site: Site, f_hat: Array, state: tuple) -> tuple:
    return tuple(p.after_step(site, f_hat, sub) for p, sub in zip(self.policies, state))

  def block_hooks(self, site: Site, depth: int):
    per_policy = [p.block_hooks(site, depth) for p in self.policies]
    if all(h is None for h in per_policy):
      return None
    blocks = []
    for i in range(depth):
      hooks = [(slot, h[i]) for slot, h in enumerate(per_policy) if h is not None and h[i] is not None]
      blocks.append(ComposedHooks(hooks) if hooks else None)
    return blocks

  def attn_mask(self, step: Step, q_levels, k_levels):
    for p in self.policies:
      if type(p).attn_mask is not ScalePolicy.attn_mask:
        return p.attn_mask(step, q_levels, k_levels)
    return super().attn_mask(step, q_levels, k_levels)

  def guide(self, site: int, halves: Halves, state: tuple):
    if self.guider is None:
      return super().guide(site, halves, state)
    out, sub = self.policies[self.guider].guide(site, halves, state[self.guider])
    return out, _with_slot(state, self.guider, sub)


def _not_next_scale(policy) -> ValueError:
  """The error for a policy compose does not take, naming its family."""
  family = next((name for cls, name in OTHER_FAMILIES if isinstance(policy, cls)), None)
  got = (f'{family} (MAR and E-CAR have one accelerator each: nothing to compose)' if family
         else 'not a next-scale policy (var_models.var.ScalePolicy)')
  return ValueError(f'compose combines next-scale (VAR) policies; got {type(policy).__name__}, {got}')


def compose(*policies: ScalePolicy) -> ScalePolicy:
  """One policy that runs every one of `policies` (at least two ScalePolicy objects)."""
  if len(policies) < 2:
    raise ValueError(f'compose takes at least two policies, got {len(policies)}')
  for p in policies:
    if not isinstance(p, ScalePolicy):
      raise _not_next_scale(p)
  return Composed(tuple(policies))
