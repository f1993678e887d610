"""Convolutional encoder/decoder of the VQGAN/LDM family (VAR's VQVAE, LDM KL-VAEs), NHWC.

Parameter names follow the PyTorch modules (conv_in, down_{i}_block_{j},
mid/block_1, ...) so converters stay a flat renaming. Padding is explicit
everywhere: flax's 'SAME' pads stride-2 convs differently from PyTorch.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from var_models.nn.attention import attention
from var_models.nn.resample import nearest_resize

Dtype = Any
_PAD1 = ((1, 1), (1, 1))


def _norm(name: str, dtype: Dtype) -> nn.GroupNorm:
  # Two-pass variance: the fast E[x^2] - E[x]^2 form drifts from torch's GroupNorm.
  return nn.GroupNorm(num_groups=32, epsilon=1e-6, use_fast_variance=False, dtype=dtype, name=name)


def _conv3(features: int, name: str, dtype: Dtype) -> nn.Conv:
  return nn.Conv(features, (3, 3), padding=_PAD1, dtype=dtype, name=name)


class ResnetBlock(nn.Module):
  """x [B, H, W, Cin] -> [B, H, W, Cout]: two GroupNorm-SiLU-conv3x3 with a (1x1) shortcut."""
  out_channels: int | None = None
  dropout: float = 0.0
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    c_out = self.out_channels or x.shape[-1]
    h = _conv3(c_out, 'conv1', self.dtype)(nn.silu(_norm('norm1', self.dtype)(x)))
    h = nn.silu(_norm('norm2', self.dtype)(h))
    if self.dropout > 1e-6:  # torch uses nn.Identity below this threshold
      h = nn.Dropout(self.dropout, deterministic=not train)(h)
    h = _conv3(c_out, 'conv2', self.dtype)(h)
    if x.shape[-1] != c_out:
      x = nn.Conv(c_out, (1, 1), dtype=self.dtype, name='nin_shortcut')(x)
    return x + h


class AttnBlock(nn.Module):
  """x [B, H, W, C] -> x + proj_out(softmax(q k^T / sqrt(C)) v): one head over all H*W positions.

  q, k, v are separate Dense layers (1x1 convs) so LDM's q/k/v convs map one to
  one and VAR's fused qkv conv is split by its converter.
  """
  dtype: Dtype = jnp.float32
  attn_backend: str = 'xla'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b, hh, ww, c = x.shape
    y = _norm('norm', self.dtype)(x)
    q, k, v = (nn.Dense(c, dtype=self.dtype, name=n)(y).reshape(b, hh * ww, 1, c) for n in 'qkv')
    o = attention(q, k, v, scale=float(c) ** -0.5, backend=self.attn_backend)
    return x + nn.Dense(c, dtype=self.dtype, name='proj_out')(o.reshape(b, hh, ww, c))


class Downsample(nn.Module):
  """x [B, H, W, C] -> [B, H/2, W/2, C]: zero-pad bottom/right by one, then 3x3 stride-2 conv."""
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    conv = nn.Conv(x.shape[-1], (3, 3), strides=(2, 2), padding=((0, 1), (0, 1)),
                   dtype=self.dtype, name='conv')
    return conv(x)


class Upsample(nn.Module):
  """x [B, H, W, C] -> [B, 2H, 2W, C]: nearest x2, then 3x3 conv."""
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    _, hh, ww, c = x.shape
    return _conv3(c, 'conv', self.dtype)(nearest_resize(x, (2 * hh, 2 * ww)))


class MidBlock(nn.Module):
  """ResnetBlock, optional self-attention, ResnetBlock at constant width."""
  using_attn: bool = True
  dropout: float = 0.0
  dtype: Dtype = jnp.float32
  attn_backend: str = 'xla'

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    x = ResnetBlock(dropout=self.dropout, dtype=self.dtype, name='block_1')(x, train)
    if self.using_attn:
      x = AttnBlock(self.dtype, self.attn_backend, name='attn_1')(x)
    return ResnetBlock(dropout=self.dropout, dtype=self.dtype, name='block_2')(x, train)


class Encoder(nn.Module):
  """img [B, H, W, Cin] -> z [B, H/f, W/f, z_channels (x2 if double_z)], f = 2^(len(ch_mult)-1).

  `using_sa` puts self-attention after every res block of the lowest-resolution
  level (LDM's attn_resolutions = (that resolution,)); `using_mid_sa` in the mid block.
  """
  ch: int = 128
  ch_mult: tuple[int, ...] = (1, 2, 4, 8)
  num_res_blocks: int = 2
  z_channels: int = 32
  double_z: bool = False
  using_sa: bool = True
  using_mid_sa: bool = True
  dropout: float = 0.0
  dtype: Dtype = jnp.float32
  attn_backend: str = 'xla'

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    h = _conv3(self.ch, 'conv_in', self.dtype)(x)
    last = len(self.ch_mult) - 1
    for i, mult in enumerate(self.ch_mult):
      for j in range(self.num_res_blocks):
        h = ResnetBlock(self.ch * mult, self.dropout, self.dtype, name=f'down_{i}_block_{j}')(h, train)
        if i == last and self.using_sa:
          h = AttnBlock(self.dtype, self.attn_backend, name=f'down_{i}_attn_{j}')(h)
      if i != last:
        h = Downsample(self.dtype, name=f'down_{i}_downsample')(h)
    h = MidBlock(self.using_mid_sa, self.dropout, self.dtype, self.attn_backend, name='mid')(h, train)
    h = nn.silu(_norm('norm_out', self.dtype)(h))
    return _conv3(2 * self.z_channels if self.double_z else self.z_channels, 'conv_out', self.dtype)(h)


class Decoder(nn.Module):
  """z [B, h, w, Cz] -> img [B, h*f, w*f, out_channels] (unclamped), mirroring `Encoder`.

  `out_channels` is what LDM/VAR call the decoder's `in_channels` (raw image channels).
  """
  ch: int = 128
  ch_mult: tuple[int, ...] = (1, 2, 4, 8)
  num_res_blocks: int = 2
  out_channels: int = 3
  using_sa: bool = True
  using_mid_sa: bool = True
  dropout: float = 0.0
  dtype: Dtype = jnp.float32
  attn_backend: str = 'xla'

  @nn.compact
  def __call__(self, z: jax.Array, train: bool = False) -> jax.Array:
    last = len(self.ch_mult) - 1
    h = _conv3(self.ch * self.ch_mult[last], 'conv_in', self.dtype)(z)
    h = MidBlock(self.using_mid_sa, self.dropout, self.dtype, self.attn_backend, name='mid')(h, train)
    for i in reversed(range(len(self.ch_mult))):
      for j in range(self.num_res_blocks + 1):
        h = ResnetBlock(self.ch * self.ch_mult[i], self.dropout, self.dtype, name=f'up_{i}_block_{j}')(h, train)
        if i == last and self.using_sa:
          h = AttnBlock(self.dtype, self.attn_backend, name=f'up_{i}_attn_{j}')(h)
      if i != 0:
        h = Upsample(self.dtype, name=f'up_{i}_upsample')(h)
    h = nn.silu(_norm('norm_out', self.dtype)(h))
    return _conv3(self.out_channels, 'conv_out', self.dtype)(h)
