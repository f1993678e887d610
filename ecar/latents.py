"""The model's data space: scaled VAE latents (the SDXL f8c4 VAE, frozen) or the pixels themselves.

encode_images: images [B, H, W, 3] in [-1, 1] -> x0 [B, h, w, D]: a posterior draw
times the VAE's scaling factor (0.13025 for SDXL), or the images unchanged in
pixel space. decode: x0 -> images [B, H, W, 3] in [0, 1]. In pixel space the VAE
params are unused (pass None).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ecar.config import ECARConfig
from var_models.nn.init import compiled_init
from var_models.tokenizers.autoencoder_kl import AutoencoderKL, sample_posterior

Array = jax.Array


def _check_images(cfg: ECARConfig, images: Array) -> None:
  want = (cfg.image_size, cfg.image_size, 3)
  if images.ndim != 4 or tuple(images.shape[1:]) != want:
    raise ValueError(f'images must be [B, {cfg.image_size}, {cfg.image_size}, 3], got {tuple(images.shape)}')


def encode_images(cfg: ECARConfig, vae_params: Any, images: Array, key: Array) -> Array:
  _check_images(cfg, images)
  images = images.astype(jnp.float32)
  if cfg.latent_space == 'pixel':
    return images
  mean, logvar = AutoencoderKL(cfg.vae).apply({'params': vae_params}, images, method=AutoencoderKL.encode)
  return jax.lax.stop_gradient(sample_posterior(mean, logvar, key) * cfg.vae.scaling_factor)


def decode(cfg: ECARConfig, vae_params: Any, x0: Array) -> Array:
  if x0.ndim != 4 or tuple(x0.shape[1:]) != cfg.data_shape:
    raise ValueError(f'x0 must be [B, {", ".join(map(str, cfg.data_shape))}], got {tuple(x0.shape)}')
  x0 = x0.astype(jnp.float32)
  if cfg.latent_space == 'vae':
    x0 = AutoencoderKL(cfg.vae).apply({'params': vae_params}, x0 / cfg.vae.scaling_factor,
                                      method=AutoencoderKL.decode)
  return jnp.clip((x0.astype(jnp.float32) + 1) * 0.5, 0.0, 1.0)


def init_vae_params(cfg: ECARConfig, key: Array) -> Any:
  """Random VAE params (None in pixel space), compiled as one program (`init.compiled_init`); real ones
  come from `python -m var_models.convert sdxl-vae`."""
  if cfg.latent_space == 'pixel':
    return None
  img = jnp.zeros((1, cfg.vae.downsample, cfg.vae.downsample, 3), jnp.float32)
  return compiled_init(lambda k: AutoencoderKL(cfg.vae).init(k, img, k)['params'], key)
