"""`compose(a, b, ...)`: several accelerators in one next-scale sampler.

The composite asks every policy at every hook and combines the answers where that has one
meaning, and raises ValueError (before compiling, or while tracing for per-step answers)
where it has none:
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
  - attn_mask: the first policy that overrides the baseline's.
"""
from __future__ import annotations

from typing import Any, Optional

import jax

from var_models.nn.blocks import BlockHooks
from var_models.var.policy import ScalePolicy, Step
from var_models.var.schedules import ScaleSchedule

Array = jax.Array


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


class Composed(ScalePolicy):
  """The policy `compose` returns."""

  def __init__(self, policies: tuple[ScalePolicy, ...]):
    self.policies = policies

  def bind(self, sched: ScaleSchedule, depth: int) -> 'Composed':
    return Composed(tuple(p.bind(sched, depth) for p in self.policies))

  def plan(self, sched: ScaleSchedule) -> tuple[Step, ...]:
    return merge_plans([p.plan(sched) for p in self.policies], sched)

  def init_state(self, sched: ScaleSchedule, batch: int) -> tuple:
    return tuple(p.init_state(sched, batch) for p in self.policies)

  def select_input(self, step_idx: int, step: Step, x: Array, state: tuple):
    chosen = None
    for slot, p in enumerate(self.policies):
      sel, sub = p.select_input(step_idx, step, x, state[slot])
      state = _with_slot(state, slot, sub)
      if sel is not None:
        if chosen is not None:
          raise ValueError(f'compose: two policies select the input tokens of step {step}')
        chosen = sel
    return chosen, state

  def input_counts(self, step: Step):
    counts = [c for c in (p.input_counts(step) for p in self.policies) if c is not None]
    return counts[0] if counts else None

  def after_step(self, step_idx: int, step: Step, f_hat: Array, state: tuple) -> tuple:
    return tuple(p.after_step(step_idx, step, f_hat, sub) for p, sub in zip(self.policies, state))

  def block_hooks(self, step_idx: int, step: Step, depth: int):
    per_policy = [p.block_hooks(step_idx, step, depth) for p in self.policies]
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


def compose(*policies: ScalePolicy) -> ScalePolicy:
  """One policy that runs every one of `policies` (at least two ScalePolicy objects)."""
  if len(policies) < 2:
    raise ValueError(f'compose takes at least two policies, got {len(policies)}')
  for p in policies:
    if not isinstance(p, ScalePolicy):
      raise ValueError(f'compose takes next-scale policies (var_models.var.ScalePolicy), got {type(p).__name__}')
  return Composed(tuple(policies))
