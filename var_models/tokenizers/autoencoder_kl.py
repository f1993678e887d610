"""LDM-style KL autoencoder (MAR's KL-16 tokenizer, the SDXL f8c4 VAE), NHWC.

img [B, H, W, 3] in [-1, 1] -> encoder -> quant_conv (1x1) -> diagonal Gaussian
posterior (mean, logvar) [B, H/f, W/f, embed_dim]; a latent z goes back through
post_quant_conv (1x1) -> decoder. Latent scaling (`scaling_factor`) is left to
the generative model that consumes the latents.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from var_models.tokenizers.conv_vae import Decoder, Encoder

LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0


@dataclasses.dataclass(frozen=True)
class AutoencoderKLConfig:
  """Defaults are MAR's KL-16 (kl16.ckpt): 256 px -> 16x16x16 latents.

  `encoder_attn` / `decoder_attn`: self-attention after every res block of the
  lowest-resolution level (LDM's attn_resolutions = (that resolution,));
  `mid_attn`: in the mid blocks. MAR's encoder has level attention, its decoder
  does not (the official Decoder defaults to attn_resolutions=()).
  """
  embed_dim: int = 16
  z_channels: int = 16
  ch: int = 128
  ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
  num_res_blocks: int = 2
  encoder_attn: bool = True
  decoder_attn: bool = False
  mid_attn: bool = True
  dropout: float = 0.0
  scaling_factor: float = 0.2325
  dtype: Any = jnp.float32
  attn_backend: str = 'xla'

  @property
  def downsample(self) -> int:
    return 2 ** (len(self.ch_mult) - 1)


KL16 = AutoencoderKLConfig()
# SDXL's VAE: no attention outside the mid blocks, 8x downsampling to 4 channels.
SDXL_F8C4 = AutoencoderKLConfig(embed_dim=4, z_channels=4, ch_mult=(1, 2, 4, 4), encoder_attn=False,
                                scaling_factor=0.13025)


def sample_posterior(mean: jax.Array, logvar: jax.Array, key: jax.Array) -> jax.Array:
  """mean, logvar [B, h, w, C] -> mean + exp(logvar / 2) * eps, eps ~ N(0, 1)."""
  eps = jax.random.normal(key, mean.shape, mean.dtype)
  return mean + jnp.exp(0.5 * logvar) * eps


class AutoencoderKL(nn.Module):
  """Initialise with `__call__` (the only method that touches every parameter)."""
  cfg: AutoencoderKLConfig

  def setup(self):
    c = self.cfg
    arch = dict(ch=c.ch, ch_mult=tuple(c.ch_mult), num_res_blocks=c.num_res_blocks, using_mid_sa=c.mid_attn,
                dropout=c.dropout, dtype=c.dtype, attn_backend=c.attn_backend)
    self.encoder = Encoder(z_channels=c.z_channels, double_z=True, using_sa=c.encoder_attn, **arch)
    self.decoder = Decoder(out_channels=3, using_sa=c.decoder_attn, **arch)
    self.quant_conv = nn.Conv(2 * c.embed_dim, (1, 1), dtype=c.dtype)
    self.post_quant_conv = nn.Conv(c.z_channels, (1, 1), dtype=c.dtype)

  def encode(self, img: jax.Array, train: bool = False) -> tuple[jax.Array, jax.Array]:
    """img [B, H, W, 3] -> posterior (mean, logvar), each [B, H/f, W/f, embed_dim] float32.

    logvar is clamped to [-30, 20]; the posterior's mode is `mean`.
    """
    moments = self.quant_conv(self.encoder(img, train)).astype(jnp.float32)
    mean, logvar = jnp.split(moments, 2, axis=-1)
    return mean, jnp.clip(logvar, LOGVAR_MIN, LOGVAR_MAX)

  def sample(self, mean: jax.Array, logvar: jax.Array, key: jax.Array) -> jax.Array:
    """A posterior draw [B, h, w, embed_dim]; uses no parameters (see `sample_posterior`)."""
    return sample_posterior(mean, logvar, key)

  def decode(self, z: jax.Array, train: bool = False) -> jax.Array:
    """z [B, h, w, embed_dim] (unscaled) -> img [B, h*f, w*f, 3], unclamped."""
    return self.decoder(self.post_quant_conv(z), train)

  def __call__(self, img: jax.Array, key: jax.Array, train: bool = False):
    """img [B, H, W, 3] -> (reconstruction of a posterior draw [B, H, W, 3], mean, logvar)."""
    mean, logvar = self.encode(img, train)
    return self.decode(sample_posterior(mean, logvar, key), train), mean, logvar


def param_count(cfg: AutoencoderKLConfig) -> int:
  """Number of parameters, from shapes only (nothing is allocated)."""
  img = jax.ShapeDtypeStruct((1, cfg.downsample, cfg.downsample, 3), jnp.float32)
  shapes = jax.eval_shape(lambda x: AutoencoderKL(cfg).init(jax.random.key(0), x, jax.random.key(1)), img)
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes['params']))
