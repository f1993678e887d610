"""DiT's timestep embedding (sinusoidal features -> Linear -> SiLU -> Linear), shared by MAR's DiffLoss
head and E-CAR's flow denoisers. Param tree of `TimestepEmbedder`: mlp_0 (FREQ_DIM -> width),
mlp_2 (width -> width), torch's `mlp.0` and `mlp.2`."""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
FREQ_DIM = 256  # sinusoidal timestep features fed to mlp_0


def timestep_embedding(t: Array, dim: int = FREQ_DIM, max_period: float = 10000.0) -> Array:
  """t [N] (int or float) -> [N, dim] float32: cos then sin of t * max_period^(-k/(dim/2))."""
  half = dim // 2
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  args = t.astype(jnp.float32)[:, None] * freqs[None]
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class TimestepEmbedder(nn.Module):
  """t [N] -> [N, width]: sinusoidal features -> Linear -> SiLU -> Linear, normal(0.02) weights and
  zero biases at init."""
  width: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, t: Array) -> Array:
    init = nn.initializers.normal(0.02)
    dense = lambda name: nn.Dense(self.width, kernel_init=init, bias_init=nn.initializers.zeros,
                                  dtype=self.dtype, name=name)
    h = dense('mlp_0')(timestep_embedding(t))
    return dense('mlp_2')(nn.silu(h))
