"""Sampling policies of E-CAR (docs/design.md, contract 4): what the sampler forwards at each AR stage
and how each flow step applies classifier-free guidance.

The sampler asks its policy, at every stage s:
  - `select_input`: which of the stage's AR input tokens [2B, N_s, C] to forward
    (a static-size subset; only those enter the KV cache);
  - `block_hooks`: per AR block, which tokens each sub-layer forwards and how the
    others are restored (`blocks.BlockHooks`, as in the VAR sampler);
  - `restore_output`: the full token map r_s [2B, N_s, C] from the forwarded rows
    when `select_input` dropped some (the denoiser needs a condition per position);
and at every Euler step of the stage's flow:
  - `guided_velocity`: the velocity to integrate, given `Denoise` (the stage's
    denoiser on the doubled [cond; uncond] batch, or on the conditional half
    alone), so a policy may skip or reuse the unconditional half.
Its own `state` (caches, index sets) is a pytree carried through the stages and
the Euler loops; inside a stage's `lax.fori_loop` it must keep its structure and
shapes. The base class is the baseline: every token, dense, plain CFG
v = v_u + scale * (v_c - v_u); it adds no operation.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from var_models.nn import tokens as tok
from var_models.nn.blocks import BlockHooks

Array = jax.Array


class Denoise(NamedTuple):
  """The stage's denoiser at the current step, on x [B, g, g, D]."""
  both: Callable[[Array], tuple[Array, Array]]  # x -> (v_cond, v_uncond), one doubled-batch call
  cond: Callable[[Array], Array]                # x -> v_cond, conditional half only


class StagePolicy:
  """The baseline policy."""

  def bind(self, cfg) -> 'StagePolicy':
    """The policy for this `ECARConfig` (the base needs nothing); raises ValueError naming the setting
    that does not fit it. The sampler binds its policy when built, before anything compiles."""
    return self

  def init_state(self, cfg, batch: int) -> Any:
    """State before stage 0; `batch` is the doubled batch 2B."""
    return None

  def select_input(self, stage: int, x: Array, state: Any):
    """Indices [2B, k] of the stage's input tokens x [2B, N_s, C] to forward, or None for all."""
    return None, state

  def block_hooks(self, stage: int, depth: int) -> Optional[Sequence[Optional[BlockHooks]]]:
    """One `BlockHooks` (or None) per AR block, or None for plain blocks."""
    return None

  def restore_output(self, stage: int, r: Array, idx: Array, num_tokens: int, state: Any):
    """r [2B, k, C] of the forwarded tokens idx [2B, k] -> [2B, num_tokens, C]; others zero here."""
    base = jnp.zeros((r.shape[0], num_tokens, r.shape[-1]), r.dtype)
    return tok.scatter(base, idx, r), state

  def guided_velocity(self, stage: int, step: Array, x: Array, denoise: Denoise, guidance: Array,
                      state: Any):
    """The velocity [B, g, g, D] at Euler step `step` (traced int) of `stage`, and the new state."""
    v_cond, v_uncond = denoise.both(x)
    return v_uncond + guidance * (v_cond - v_uncond), state


BASELINE = StagePolicy()
