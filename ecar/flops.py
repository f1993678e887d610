"""FLOPs of sampling one image, from XLA's cost analysis of the compiled sampler.

XLA's cost analysis counts a while loop's body once, whatever its trip count.
So the sampler is compiled with one Euler step per stage (a loop of one trip,
counted once either way), and each stage's remaining n_s - 1 steps are added as
the cost of that stage's Euler step compiled alone (the loop body itself):
    total = cost(sampler with 1 step per stage) + sum_s (n_s - 1) * cost(step_s).
Nothing is allocated: params are shapes only. The VAE decoder's share is
reported apart ('decode'), since papers often leave it out.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

from ecar.config import ECARConfig
from ecar.latents import decode, init_vae_params
from ecar.model import abstract_params
from ecar.policy import StagePolicy
from ecar.sampler import _Sampler, make_sampler, steps_per_stage


def _flops(lowered) -> float:
  cost = lowered.compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost['flops'])


def _step_flops(sampler: _Sampler, params, s: int, batch: int) -> float:
  cfg = sampler.cfg
  g = cfg.stage_sizes[s]
  x = jax.ShapeDtypeStruct((batch, g, g, cfg.data_channels), jnp.float32)
  cond = jax.ShapeDtypeStruct((2 * batch, cfg.stage_tokens[s], cfg.den_width), jnp.float32)
  state = sampler.policy.init_state(cfg, 2 * batch)
  step = jax.jit(lambda p, x, c, scale: sampler.euler_step({'params': p}, s, jnp.int32(0), x, c, scale, state)[0])
  return _flops(step.lower(params, x, cond, jax.ShapeDtypeStruct((), jnp.float32)))


def sampling_flops(cfg: ECARConfig, *, num_steps: Union[int, Sequence[int]] = 250, batch: int = 1,
                   policy: Optional[StagePolicy] = None) -> dict:
  """{'per_image', 'per_image_without_decode', 'decode', 'base', 'step'}: FLOPs per image of
  the whole sampler (with CFG's doubled batch), without the VAE decoder, of the decoder alone,
  of the sampler at one step per stage, and of one Euler step per stage."""
  steps = steps_per_stage(cfg, num_steps)
  params = abstract_params(cfg)
  vae = jax.eval_shape(lambda k: init_vae_params(cfg, k), jax.random.key(0))
  key = jax.eval_shape(lambda: jax.random.key(0))
  labels = jnp.zeros((batch,), jnp.int32)
  one = make_sampler(cfg, num_steps=(1,) * cfg.num_stages, policy=policy)
  base = _flops(one.lower(params, vae, key, labels, cfg_scale=1.5))
  step = [_step_flops(one, params, s, batch) for s in range(cfg.num_stages)]
  x0 = jax.ShapeDtypeStruct((batch, *cfg.data_shape), jnp.float32)
  dec = _flops(jax.jit(lambda v, x: decode(cfg, v, x)).lower(vae, x0))
  total = base + sum((n - 1) * f for n, f in zip(steps, step))
  return {'per_image': total / batch, 'per_image_without_decode': (total - dec) / batch, 'decode': dec / batch,
          'base': base / batch, 'step': [f / batch for f in step], 'steps_per_stage': steps}
