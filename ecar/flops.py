"""FLOPs of sampling one image, counted on the sampler's jaxpr (`var_models.flop_count`).

Every Euler step counts (the stages' `fori_loop`s have static trip counts), both
halves of the CFG batch included. Nothing is allocated: params are shapes only.
The VAE decoder's share is reported apart ('decode'), since papers often leave it out.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

from ecar.config import ECARConfig
from ecar.latents import decode, init_vae_params
from ecar.model import abstract_params
from ecar.policy import StagePolicy
from ecar.sampler import make_sampler, steps_per_stage
from var_models.flop_count import flops


def sampling_flops(cfg: ECARConfig, *, num_steps: Union[int, Sequence[int]] = 250, batch: int = 1,
                   policy: Optional[StagePolicy] = None) -> dict:
  """{'per_image', 'per_image_without_decode', 'decode', 'steps_per_stage'}: FLOPs per image of
  the whole sampler, of the sampler without the VAE decoder, and of the decoder alone."""
  sampler = make_sampler(cfg, num_steps=num_steps, policy=policy)
  params = abstract_params(cfg)
  vae = jax.eval_shape(lambda k: init_vae_params(cfg, k), jax.random.key(0))
  key = jax.eval_shape(lambda: jax.random.key(0))
  labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
  total = flops(sampler._sample, {'ecar': params, 'vae': vae}, key, labels, jax.ShapeDtypeStruct((), jnp.float32))
  x0 = jax.ShapeDtypeStruct((batch, *cfg.data_shape), jnp.float32)
  dec = flops(lambda v, x: decode(cfg, v, x), vae, x0)
  return {'per_image': total / batch, 'per_image_without_decode': (total - dec) / batch, 'decode': dec / batch,
          'steps_per_stage': steps_per_stage(cfg, num_steps)}
