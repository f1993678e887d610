"""LPIPS (Zhang et al. 2018), network 'vgg', version 0.1: a learned perceptual distance, NHWC.

Both images pass LPIPS's ScalingLayer and torchvision's VGG16 feature trunk (13 3x3 convs
with ReLU, a 2x2 max pool before each of blocks 2-5). At relu1_2, relu2_2, relu3_3,
relu4_3 and relu5_3 every feature vector is unit-normalised over channels; the squared
difference of the two images' vectors is weighted per channel by a 1x1 no-bias conv
('lin'), averaged over positions, and the five taps are summed. Parameters come from
`python -m var_models.convert lpips` (torchvision's vgg16 weights + the lpips package's
v0.1 lin weights); the distance is a pure function of them.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any

# LPIPS's ScalingLayer: (x - SHIFT) / SCALE maps [-1, 1] images to ImageNet-normalised ones.
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)
EPS = 1e-10  # the package's normalize_tensor
# torchvision's vgg16().features: (convs, channels) per block; each block's last ReLU is a tap.
VGG16_BLOCKS = ((2, 64), (2, 128), (3, 256), (3, 512), (3, 512))
TAP_CHANNELS = tuple(c for _, c in VGG16_BLOCKS)
MIN_SIZE = 2 ** (len(VGG16_BLOCKS) - 1)  # relu5_3 sits after four 2x2 pools


class VGG16Features(nn.Module):
  """x [B, H, W, 3] (ImageNet-normalised) -> the five taps [B, H / 2^k, W / 2^k, C_k], k = 0..4."""
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> list[jax.Array]:
    taps = []
    for b, (convs, channels) in enumerate(VGG16_BLOCKS):
      if b:
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
      for i in range(convs):
        conv = nn.Conv(channels, (3, 3), padding=((1, 1), (1, 1)), dtype=self.dtype, name=f'conv{b + 1}_{i + 1}')
        x = nn.relu(conv(x))
      taps.append(x)
    return taps


def _unit_normalise(f: jax.Array) -> jax.Array:
  """f [..., C] -> f / (|f| + EPS) over channels."""
  return f / (jnp.sqrt(jnp.sum(jnp.square(f), axis=-1, keepdims=True)) + EPS)


class LPIPS(nn.Module):
  """(x, y) [B, H, W, 3] in [-1, 1], H, W >= 16 -> distance [B] float32.

  The VGG convs compute in `dtype`; normalisation, differences and the lin layers in
  float32 (the eps of 1e-10 and the sums over 512 channels need it).
  """
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array:
    if x.shape != y.shape or x.ndim != 4 or x.shape[-1] != 3:
      raise ValueError(f'LPIPS needs two images [B, H, W, 3] of one shape, got {x.shape} and {y.shape}')
    if min(x.shape[1:3]) < MIN_SIZE:
      raise ValueError(f'LPIPS (VGG16) needs images of at least {MIN_SIZE} x {MIN_SIZE} px, got {x.shape}')
    both = jnp.concatenate([x, y], axis=0).astype(jnp.float32)
    both = (both - jnp.asarray(SHIFT, jnp.float32)) / jnp.asarray(SCALE, jnp.float32)
    taps = VGG16Features(self.dtype, name='vgg')(both.astype(self.dtype))
    dist = jnp.zeros((x.shape[0],), jnp.float32)
    for k, tap in enumerate(taps):
      fx, fy = jnp.split(tap.astype(jnp.float32), 2, axis=0)
      diff = jnp.square(_unit_normalise(fx) - _unit_normalise(fy))
      lin = nn.Conv(1, (1, 1), use_bias=False, name=f'lin{k}')(diff)
      dist = dist + jnp.mean(lin, axis=(1, 2, 3))
    return dist
