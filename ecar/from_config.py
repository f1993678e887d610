"""`ecar_config`: an ECARConfig from a configs/ecar.py ml_collections config, every error naming its key;
`ecar_params`: its parameters, random or from checkpoints."""
from __future__ import annotations

from typing import Optional

import jax

from ecar.config import ECARConfig, ECARConfigError
from ecar.loss import check_gradnorm_layer
from ecar.latents import init_vae_params
from ecar.model import abstract_params, init_params
from var_models import checkpoint
from var_models.nn.checks import check_attn_backend, compute_dtype
from var_models.tokenizers.autoencoder_kl import AutoencoderKLConfig

# ECARConfig field -> configs/ecar.py key.
CONFIG_KEYS = {
    'image_size': 'image_size', 'num_classes': 'num_classes', 'latent_space': 'latent_space',
    'num_stages': 'model.num_stages', 'patch_size': 'model.patch_size', 'ar_depth': 'model.ar_depth',
    'ar_width': 'model.ar_width', 'ar_heads': 'model.ar_heads', 'den_depth': 'model.den_depth',
    'den_width': 'model.den_width', 'den_heads': 'model.den_heads', 'mlp_ratio': 'model.mlp_ratio',
    'cond_drop_rate': 'model.cond_drop_rate', 'gamma': 'flow.gamma',
    'num_train_timesteps': 'flow.num_train_timesteps', 'time_windows': 'flow.time_windows',
    'gradnorm_lr': 'gradnorm.lr', 'gradnorm_alpha': 'gradnorm.alpha', 'gradnorm_layer': 'gradnorm.layer',
    'gradnorm_min_weight': 'gradnorm.min_weight', 'attn_backend': 'attn_backend', 'dtype': 'dtype',
    'scan_blocks': 'model.scan_blocks',
}


def _vae_config(config, dtype) -> AutoencoderKLConfig:
  v = config.vae
  try:
    return AutoencoderKLConfig(**{**v.to_dict(), 'ch_mult': tuple(v.ch_mult)}, dtype=dtype,
                               attn_backend=config.attn_backend)
  except TypeError as e:
    raise ValueError(f'bad config.vae: {e}') from None


def ecar_config(config) -> ECARConfig:
  """ECARConfig from a configs/ecar.py config; a bad value is a ValueError naming its config key."""
  dtype = compute_dtype(config.dtype)
  m, f, g = config.model, config.flow, config.gradnorm
  fields = dict(
      image_size=config.image_size, num_classes=config.num_classes, latent_space=config.latent_space,
      vae=_vae_config(config, dtype), num_stages=m.num_stages, patch_size=m.patch_size,
      ar_depth=m.ar_depth, ar_width=m.ar_width, ar_heads=m.ar_heads, den_depth=m.den_depth,
      den_width=m.den_width, den_heads=m.den_heads, mlp_ratio=m.mlp_ratio, cond_drop_rate=m.cond_drop_rate,
      gamma=f.gamma, num_train_timesteps=f.num_train_timesteps, time_windows=f.time_windows,
      gradnorm_lr=g.lr, gradnorm_alpha=g.alpha, gradnorm_layer=g.layer, gradnorm_min_weight=g.min_weight,
      attn_backend=config.attn_backend, dtype=dtype, scan_blocks=m.get('scan_blocks', False))
  check_attn_backend(config.attn_backend)
  try:
    cfg = ECARConfig(**fields)
  except ECARConfigError as e:
    raise ValueError(f'config.{CONFIG_KEYS[e.field]}: {e.message}') from None
  try:
    check_gradnorm_layer(cfg, abstract_params(cfg))
  except ValueError as e:
    raise ValueError(f'config.gradnorm.layer: {e}') from None
  return cfg


def ecar_params(cfg: ECARConfig, ckpt: Optional[str], vae_ckpt: Optional[str], key) -> dict:
  """{'ecar', 'vae'} params: E-CAR's from `ckpt` (a training workdir or a params checkpoint), else random;
  the frozen VAE of a latent-space E-CAR (None in pixel space) from `vae_ckpt`, else `ckpt`'s export,
  else random."""
  k_model, k_vae = jax.random.split(key)
  model = checkpoint.load_component(ckpt, 'ecar', abstract_params(cfg)) if ckpt else init_params(cfg, k_model)
  vae_ckpt = vae_ckpt or ckpt
  if cfg.latent_space == 'pixel':
    vae = None
  elif not vae_ckpt:
    vae = init_vae_params(cfg, k_vae)
  else:
    abstract = jax.eval_shape(lambda k: init_vae_params(cfg, k), jax.random.key(0))
    try:
      vae = checkpoint.load_component(vae_ckpt, 'vae', abstract)
    except ValueError as e:
      raise ValueError(f'{e}; E-CAR in latent space needs its frozen VAE: --config.vae_ckpt '
                       "(python -m var_models.convert sdxl-vae), else the --ckpt workdir's export") from None
  return {'ecar': model, 'vae': vae}
