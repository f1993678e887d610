"""LazyMAR's condition cache carried over to E-CAR's guided flow steps (no paper tried it: ours).

    sample = ecar.make_sampler(cfg, num_steps=250, policy=accel.ECARConditionCache.preset('every_2'))

In each chosen stage, Euler step i (0-based, local to the stage) is *full* when i % interval == 0:
the denoiser runs on the doubled [cond; uncond] batch and the residual v_u - v_c is kept; the
other steps run the conditional half only and take v_u = v_c + that residual. The guided
velocity is v_u + scale * (v_c - v_u) either way. The full/cached choice is a `lax.cond` on the
traced step inside the stage's Euler loop (the sampler's loop is a `fori_loop`).

LazyMAR's other idea, a token cache on the last stage's denoiser, is not here: measured
(`benchmarks/ecar_token_cache.py`, benchmarks/RESULTS.md), most tokens' velocity moves < 1 % per
step, but a denoiser block costs nearly as much on 4 tokens as on 64 at batch 1 (E-CAR-L, H200),
so skipping tokens could save at most ~7 % of the sampler before its gathers and scatters.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from accel.presets import Presets, setting_error
from ecar.policy import Denoise, StagePolicy

Array = jax.Array

# name -> (settings, where they come from)
PRESETS = {
    'every_2': (dict(interval=2), 'ours: a full step every 2nd Euler step of every stage'),
    'every_3': (dict(interval=3), 'ours: a full step every 3rd Euler step of every stage'),
    'every_5': (dict(interval=5), 'ours: a full step every 5th Euler step of every stage'),
    'last_every_3': (dict(interval=3, stages=(-1,)), 'ours: every 3rd step of the last (largest) stage only'),
}


@dataclasses.dataclass(frozen=True)
class ECARConditionCache(Presets, StagePolicy):
  """Static settings (see the module docstring):
    interval -- a full (both halves) step every `interval` Euler steps of a stage, from its first;
    stages   -- the stages that cache (negative counts from the last; None: every stage);
    source   -- where the setting comes from (presets say).
  """
  PRESETS: ClassVar[dict] = PRESETS
  interval: int = 2
  stages: Optional[tuple[int, ...]] = None
  source: str = 'user'

  def __post_init__(self):
    if not isinstance(self.interval, int) or self.interval < 1:
      raise setting_error(self, 'interval', f'must be an int >= 1, got {self.interval!r}')
    if self.stages is not None:
      stages = tuple(int(s) for s in self.stages)
      if not stages or len(set(stages)) != len(stages):
        raise setting_error(self, 'stages', f'must be distinct stage indices, got {self.stages}')
      object.__setattr__(self, 'stages', stages)

  def bind(self, cfg) -> 'ECARConditionCache':
    n = cfg.num_stages
    if self.stages is not None and any(not -n <= s < n for s in self.stages):
      raise setting_error(self, 'stages', f'{self.stages} is outside the {n} stages')
    return self

  def init_state(self, cfg, batch: int) -> dict:
    """One residual [B, g, g, D] per stage (batch is the doubled 2B)."""
    return {'residual': tuple(jnp.zeros((batch // 2, g, g, cfg.data_channels), jnp.float32)
                              for g in cfg.stage_sizes)}

  def caches(self, stage: int, num_stages: int) -> bool:
    return self.stages is None or stage in {s % num_stages for s in self.stages}

  def guided_velocity(self, stage: int, step: Array, x: Array, denoise: Denoise, guidance: Array, state: dict):
    if not self.caches(stage, len(state['residual'])):
      return super().guided_velocity(stage, step, x, denoise, guidance, state)

    def full(_):
      v_c, v_u = denoise.both(x)
      return v_c.astype(jnp.float32), (v_u - v_c).astype(jnp.float32)

    def cached(_):
      return denoise.cond(x).astype(jnp.float32), state['residual'][stage]

    v_c, residual = jax.lax.cond(step % self.interval == 0, full, cached, None)
    v_u = v_c + residual
    residuals = state['residual'][:stage] + (residual,) + state['residual'][stage + 1:]
    return v_u + guidance * (v_c - v_u), {**state, 'residual': residuals}
