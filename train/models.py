"""From an ml_collections config to model configs and parameters, validated key by key."""
from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from var_models import checkpoint
from var_models.mar import model as mar_lib
from var_models.nn import checks
from var_models.tokenizers.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig

def compute_dtype(config) -> Any:
  """config.dtype of a family config -> the jnp dtype."""
  return checks.compute_dtype(config.dtype)


def mar_configs(config) -> tuple[mar_lib.MARConfig, AutoencoderKLConfig]:
  """(MARConfig, AutoencoderKLConfig) from a configs/mar.py config; errors name the config key."""
  dtype = compute_dtype(config)
  checks.check_attn_backend(config.attn_backend)
  try:
    vae_cfg = AutoencoderKLConfig(**{**config.vae.to_dict(), 'ch_mult': tuple(config.vae.ch_mult)},
                                  dtype=dtype)
    mar_cfg = mar_lib.MARConfig(**config.model.to_dict(), attn_backend=config.attn_backend, dtype=dtype)
  except (TypeError, ValueError) as e:
    raise ValueError(f'bad config.model / config.vae: {e}') from e
  if mar_cfg.vae_stride != vae_cfg.downsample or mar_cfg.vae_embed_dim != vae_cfg.embed_dim:
    raise ValueError(f'config.model.vae_stride={mar_cfg.vae_stride} / vae_embed_dim={mar_cfg.vae_embed_dim} '
                     f'do not match config.vae (downsample {vae_cfg.downsample}, embed_dim {vae_cfg.embed_dim})')
  return mar_cfg, vae_cfg


def init_mar_params(mar_cfg: mar_lib.MARConfig, vae_cfg: AutoencoderKLConfig, key) -> dict:
  """Random {'mar', 'vae'} params (official init)."""
  k1, k2, k3 = jax.random.split(key, 3)
  img = jnp.zeros((1, mar_cfg.img_size, mar_cfg.img_size, 3), jnp.float32)
  return {'mar': mar_lib.init_params(mar_cfg, k1), 'vae': AutoencoderKL(vae_cfg).init(k2, img, k3)['params']}


def load_mar_params(mar_cfg: mar_lib.MARConfig, vae_cfg: AutoencoderKLConfig, directory: str) -> dict:
  """Params from a checkpoint directory written by `python -m var_models.convert mar` or training."""
  abstract = jax.eval_shape(lambda k: init_mar_params(mar_cfg, vae_cfg, k), jax.random.key(0))
  return checkpoint.load_params(directory, abstract)


def load_component(directory: str, name: str, abstract: Any) -> Any:
  """One part (e.g. 'vqvae', 'vae') of a params checkpoint laid out like `abstract`.

  The checkpoint may hold other parts of any shape (a converted {'var', 'vqvae'}
  of another depth); only `name` is checked and returned.
  """
  path = os.path.join(os.path.abspath(directory), 'params')
  if not os.path.isdir(path):
    raise FileNotFoundError(f'no parameter checkpoint at {path}')
  with ocp.StandardCheckpointer() as ckptr:
    stored = ckptr.metadata(path)
    stored = getattr(stored, 'item_metadata', stored)
    if name not in stored:
      raise ValueError(f'checkpoint {directory} holds no {name!r} parameters (it has {sorted(stored)})')
    checkpoint.check_tree(abstract, stored[name], f'checkpoint {directory} [{name!r}]')
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), dict(stored))
    return ckptr.restore(path, target)[name]
