"""LazyMAR's condition cache carried over to E-CAR's guided flow steps (no paper tried it: ours).

    sample = ecar.make_sampler(cfg, num_steps=250, policy=accel.ECARConditionCache.preset('every_2'))

In each chosen stage, Euler step i (0-based, local to the stage) is *full* when i % interval == 0:
the denoiser runs on the doubled [cond; uncond] batch and the residual v_u - v_c is kept; the
other steps run the conditional half only and take v_u = v_c + that residual. `guide` returns
(v_c, v_u) and the sampler mixes them, v_u + scale * (v_c - v_u), either way. The full/cached choice
is a `lax.cond` on the traced step inside the stage's Euler loop (the sampler's loop is a `fori_loop`).

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
from ecar.config import ECARConfig
from ecar.policy import FlowStep, StagePolicy
from var_models.nn.policy import Binding, Halves

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
    source   -- where the setting comes from (presets say);
    ecar_cfg -- the model's config, set by `bind` (the stage count, the residuals' shapes).
  """
  PRESETS: ClassVar[dict] = PRESETS
  interval: int = 2
  stages: Optional[tuple[int, ...]] = None
  source: str = 'user'
  ecar_cfg: Optional[ECARConfig] = dataclasses.field(default=None, repr=False, compare=False)

  def __post_init__(self):
    if not isinstance(self.interval, int) or self.interval < 1:
      raise setting_error(self, 'interval', f'must be an int >= 1, got {self.interval!r}')
    if self.stages is not None:
      stages = tuple(int(s) for s in self.stages)
      if not stages or len(set(stages)) != len(stages):
        raise setting_error(self, 'stages', f'must be distinct stage indices, got {self.stages}')
      object.__setattr__(self, 'stages', stages)

  def bind(self, binding: Binding) -> 'ECARConditionCache':
    n = binding.model.num_stages
    if self.stages is not None and any(not -n <= s < n for s in self.stages):
      raise setting_error(self, 'stages', f'{self.stages} is outside the {n} stages')
    return dataclasses.replace(self, ecar_cfg=binding.model)

  def _cfg(self) -> ECARConfig:
    if self.ecar_cfg is None:
      raise ValueError('ECARConditionCache: unbound; the sampler binds it (or call `bind(Binding(...))`)')
    return self.ecar_cfg

  def init_state(self, batch: int) -> dict:
    """One residual v_u - v_c [B, g, g, D] float32 per stage (B = batch samples)."""
    cfg = self._cfg()
    return {'residual': tuple(jnp.zeros((batch, g, g, cfg.data_channels), jnp.float32)
                              for g in cfg.stage_sizes)}

  def caches(self, stage: int) -> bool:
    """Whether `stage` caches (the others run plain guidance)."""
    return self.stages is None or stage in {s % self._cfg().num_stages for s in self.stages}

  def guide(self, site: FlowStep, halves: Halves, state: dict):
    """(v_c, v_u) [B, g, g, D] float32 at Euler step site.step of site.stage: both halves computed
    on full steps, v_u = v_c + the stage's residual on cached ones; the new state."""
    stage = site.stage
    if not self.caches(stage):
      return super().guide(site, halves, state)

    def full(_):
      v_c, v_u = halves.both()
      return v_c.astype(jnp.float32), (v_u - v_c).astype(jnp.float32)

    def cached(_):
      return halves.cond().astype(jnp.float32), state['residual'][stage]

    v_c, residual = jax.lax.cond(site.step % self.interval == 0, full, cached, None)
    residuals = state['residual'][:stage] + (residual,) + state['residual'][stage + 1:]
    return (v_c, v_c + residual), {**state, 'residual': residuals}
