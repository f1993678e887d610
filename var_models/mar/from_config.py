"""MAR and its KL VAE from a configs/mar.py ml_collections config (every error naming its key), and
their parameters: random (the official init) or from a checkpoint directory. `train`,
`python -m train.sample` and `python -m accel.compare` read configs through these.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from var_models import checkpoint
from var_models.mar import model as mar_lib
from var_models.nn import checks
from var_models.nn.init import compiled_init
from var_models.tokenizers.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig


def mar_configs(config) -> tuple[mar_lib.MARConfig, AutoencoderKLConfig]:
  """(MARConfig, AutoencoderKLConfig) from a configs/mar.py config; errors name the config key."""
  dtype = checks.compute_dtype(config.dtype)
  checks.check_attn_backend(config.attn_backend)
  try:
    vae_cfg = AutoencoderKLConfig(**{**config.vae.to_dict(), 'ch_mult': tuple(config.vae.ch_mult)},
                                  dtype=dtype)
    mar_cfg = mar_lib.MARConfig(**config.model.to_dict(), class_num=config.num_classes,
                                attn_backend=config.attn_backend, dtype=dtype)
  except (TypeError, ValueError) as e:
    raise ValueError(f'bad config.model / config.vae: {e}') from e
  if mar_cfg.vae_stride != vae_cfg.downsample or mar_cfg.vae_embed_dim != vae_cfg.embed_dim:
    raise ValueError(f'config.model.vae_stride={mar_cfg.vae_stride} / vae_embed_dim={mar_cfg.vae_embed_dim} '
                     f'do not match config.vae (downsample {vae_cfg.downsample}, embed_dim {vae_cfg.embed_dim})')
  return mar_cfg, vae_cfg


def init_mar_params(mar_cfg: mar_lib.MARConfig, vae_cfg: AutoencoderKLConfig, key) -> dict:
  """Random {'mar', 'vae'} params (official init), compiled as one program (`init.compiled_init`)."""
  def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    img = jnp.zeros((1, mar_cfg.img_size, mar_cfg.img_size, 3), jnp.float32)
    return {'mar': mar_lib.init_params(mar_cfg, k1), 'vae': AutoencoderKL(vae_cfg).init(k2, img, k3)['params']}
  return compiled_init(init, key)


def load_mar_params(mar_cfg: mar_lib.MARConfig, vae_cfg: AutoencoderKLConfig, directory: str) -> dict:
  """Params from a checkpoint directory written by `python -m var_models.convert mar` or training."""
  abstract = jax.eval_shape(lambda k: init_mar_params(mar_cfg, vae_cfg, k), jax.random.key(0))
  return checkpoint.load_params(directory, abstract)
