"""E-CAR's sampling policy (docs/design.md, contract 4): the core `var_models.nn.policy.Policy` at E-CAR's
sites, with two hooks of its own for pruning the AR's input.

The sampler binds its policy to `Binding(model=ECARConfig, schedule=Euler steps per stage,
guided=True)` (E-CAR always samples the doubled [cond; uncond] batch) and asks it for
`init_state(B)` before stage 0. Then, at every AR stage s:
  - `select_input`: which of the stage's AR input tokens [2B, N_s, C] to forward
    (a static-size subset; only those enter the KV cache);
  - `block_hooks(s, depth)`: per AR block, which tokens each sub-layer forwards and how the
    others are restored (`blocks.BlockHooks`, as in the VAR sampler); the site is the stage index;
  - `restore_output`: the full token map r_s [2B, N_s, C] from the forwarded rows
    when `select_input` dropped some (the denoiser needs a condition per position);
and at every Euler step of the stage's flow:
  - `guide(FlowStep(s, i), halves, state)`: the conditional and unconditional velocities
    (v_c, v_u), each [B, g, g, D] float32, computed by `halves.both()` (the denoiser on the doubled
    batch) or made from `halves.cond()` (the conditional half alone), so a policy may skip or reuse
    the unconditional half; the sampler integrates v_u + scale * (v_c - v_u).
Its own `state` (caches, index sets) is a pytree carried through the stages and the Euler loops;
inside a stage's `lax.fori_loop` it must keep its structure and shapes. The base class is the
baseline: every token, dense, both halves computed; it adds no operation.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from var_models.nn import tokens as tok
from var_models.nn.policy import Policy

Array = jax.Array


class FlowStep(NamedTuple):
  """The site of `guide`: Euler step `step` of stage `stage`'s flow. The stage is static (each has
  its own shapes); the step is the traced int32 loop index of the stage's `fori_loop`, 0-based and
  local to the stage (local time step / steps[stage])."""
  stage: int
  step: Array


class StagePolicy(Policy):
  """The baseline policy."""

  def select_input(self, stage: int, x: Array, state: Any):
    """Indices [2B, k] of the stage's input tokens x [2B, N_s, C] to forward, or None for all."""
    return None, state

  def restore_output(self, stage: int, r: Array, idx: Array, num_tokens: int, state: Any):
    """r [2B, k, C] of the forwarded tokens idx [2B, k] -> [2B, num_tokens, C]; others zero here."""
    base = jnp.zeros((r.shape[0], num_tokens, r.shape[-1]), r.dtype)
    return tok.scatter(base, idx, r), state


BASELINE = StagePolicy()
