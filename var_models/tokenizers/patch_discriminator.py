"""VQGAN's PatchGAN discriminator (taming's NLayerDiscriminator, after pix2pix) and its hinge losses, NHWC.

`num_layers` stride-2 4x4 convs (channels c, 2c, 4c, ... capped at 8c), one stride-1 4x4
conv to min(2^num_layers, 8) c channels, and a stride-1 4x4 conv to one logit per patch;
LeakyReLU(0.2) after every conv but the last, a normalisation after every conv but the
first and the last (those two have biases; the normalised ones none, as in VQGAN).
Init as VQGAN's weights_init: conv kernels ~ N(0, 0.02), norm scales ~ N(1, 0.02), norm
biases 0; the two conv biases keep PyTorch's default U(+-1 / sqrt(fan_in)), which
weights_init leaves alone.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any
_PAD1 = ((1, 1), (1, 1))


def patch_grid(size: int, num_layers: int) -> int:
  """Side of the logit map for a `size` px input (< 1: too small an input for `num_layers`)."""
  for _ in range(num_layers):
    size //= 2  # 4x4, stride 2, padding 1
  return size - 2  # two 4x4 stride-1 convs with padding 1 take one each


def _scale_init(key, shape, dtype=jnp.float32):
  return 1.0 + 0.02 * jax.random.normal(key, shape, dtype)


def _torch_bias_init(fan_in: int):
  bound = fan_in ** -0.5
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class BatchStatNorm(nn.Module):
  """x [B, H, W, C] -> (x - mean) / sqrt(var + 1e-5) * scale + bias, statistics per channel over (B, H, W).

  VQGAN's BatchNorm2d in training mode without the running averages: the discriminator
  only ever runs while training, where BatchNorm normalises with the batch's own statistics
  and its running averages are written but never read. Leaving them out keeps the
  discriminator a pure function of (params, input) with no mutable collection to thread
  through the train step. Statistics are float32 and span the whole batch that one call
  sees (on a device mesh, the global batch).
  """
  eps: float = 1e-5

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = x.shape[-1]
    scale = self.param('scale', _scale_init, (c,), jnp.float32)
    bias = self.param('bias', nn.initializers.zeros, (c,), jnp.float32)
    h = x.astype(jnp.float32)
    mean = jnp.mean(h, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(h - mean), axis=(0, 1, 2))  # two-pass, biased, as torch normalises
    return ((h - mean) * jax.lax.rsqrt(var + self.eps) * scale + bias).astype(x.dtype)


class PatchDiscriminator(nn.Module):
  """x [B, H, W, 3] in [-1, 1] -> logits [B, h, w] float32, h = patch_grid(H, num_layers) (30 for 256 px)."""
  channels: int = 64
  num_layers: int = 3
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if min(patch_grid(x.shape[1], self.num_layers), patch_grid(x.shape[2], self.num_layers)) < 1:
      raise ValueError(f'a PatchGAN of {self.num_layers} layers needs images of at least '
                       f'{3 * 2 ** self.num_layers} px, got {x.shape}')
    h = x.astype(self.dtype)
    mults = [min(2 ** n, 8) for n in range(self.num_layers + 1)]
    for n, mult in enumerate(mults):
      first = n == 0
      conv = nn.Conv(self.channels * mult, (4, 4), strides=1 if n == self.num_layers else 2, padding=_PAD1,
                     use_bias=first, kernel_init=nn.initializers.normal(0.02),
                     bias_init=_torch_bias_init(16 * h.shape[-1]), dtype=self.dtype, name=f'conv_{n}')
      h = conv(h)
      if not first:
        h = BatchStatNorm(name=f'norm_{n}')(h)
      h = nn.leaky_relu(h, 0.2)
    out = nn.Conv(1, (4, 4), padding=_PAD1, kernel_init=nn.initializers.normal(0.02),
                  bias_init=_torch_bias_init(16 * h.shape[-1]), dtype=self.dtype, name=f'conv_{self.num_layers + 1}')
    return out(h)[..., 0].astype(jnp.float32)


def discriminator_hinge_loss(logits_real: jax.Array, logits_fake: jax.Array) -> jax.Array:
  """VQGAN's hinge loss for the discriminator: (mean relu(1 - real) + mean relu(1 + fake)) / 2."""
  return 0.5 * (jnp.mean(jax.nn.relu(1.0 - logits_real)) + jnp.mean(jax.nn.relu(1.0 + logits_fake)))


def generator_loss(logits_fake: jax.Array) -> jax.Array:
  """The generator's adversarial loss of the hinge GAN: -mean(D(fake))."""
  return -jnp.mean(logits_fake)
