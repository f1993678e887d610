"""From an ml_collections config to model configs and parameters, validated key by key."""
from __future__ import annotations

import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from var_models import checkpoint
from var_models.mar import model as mar_lib
from var_models.nn import checks
from var_models.tokenizers.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
from var_models.tokenizers.vqvae import VQVAE, VQVAEConfig
from var_models.var.model import VARConfig, init_params

def compute_dtype(config) -> Any:
  """config.dtype of a family config -> the jnp dtype."""
  return checks.compute_dtype(config.dtype)


def vqvae_config(config) -> VQVAEConfig:
  """VQVAEConfig from config.vqvae and config.patch_nums (configs/var.py); errors name the key."""
  q = config.vqvae
  try:
    vq_cfg = VQVAEConfig(vocab_size=q.vocab_size, z_channels=q.z_channels, ch=q.ch,
                         ch_mult=tuple(q.ch_mult), num_res_blocks=q.num_res_blocks, beta=q.beta,
                         quant_resi=q.quant_resi, share_quant_resi=q.share_quant_resi,
                         patch_nums=tuple(int(p) for p in config.patch_nums), dtype=compute_dtype(config))
  except ValueError as e:
    raise ValueError(f'bad config.vqvae: {e}') from e
  if config.image_size != vq_cfg.image_size:
    raise ValueError(f'config.image_size={config.image_size} does not match config.patch_nums '
                     f'{vq_cfg.patch_nums} (last scale {vq_cfg.patch_nums[-1]} x downsample '
                     f'{vq_cfg.downsample} = {vq_cfg.image_size})')
  return vq_cfg


def var_configs(config) -> tuple[VARConfig, VQVAEConfig]:
  """(VARConfig, VQVAEConfig) from a configs/var.py config; errors name the config key."""
  checks.check_attn_backend(config.attn_backend)
  vq_cfg = vqvae_config(config)
  m = config.model
  try:
    var_cfg = VARConfig(depth=m.depth, width=m.width, num_heads=m.num_heads, mlp_ratio=m.mlp_ratio,
                        num_classes=config.num_classes, vocab_size=vq_cfg.vocab_size, cvae=vq_cfg.z_channels,
                        patch_nums=vq_cfg.patch_nums, shared_aln=m.shared_aln, attn_l2_norm=m.attn_l2_norm,
                        norm_eps=m.norm_eps, drop_rate=m.drop_rate, drop_path_rate=m.drop_path_rate,
                        cond_drop_rate=m.cond_drop_rate, attn_backend=config.attn_backend,
                        dtype=compute_dtype(config))
  except ValueError as e:
    raise ValueError(f'bad config.model: {e}') from e
  return var_cfg, vq_cfg


def init_var_params(var_cfg: VARConfig, vq_cfg: VQVAEConfig, key) -> dict:
  """Random {'var', 'vqvae'} params (official init for VAR)."""
  k1, k2 = jax.random.split(key)
  img = jnp.zeros((1, vq_cfg.image_size, vq_cfg.image_size, 3), jnp.float32)
  return {'var': init_params(var_cfg, k1), 'vqvae': VQVAE(vq_cfg).init(k2, img)['params']}


def load_var_params(var_cfg: VARConfig, vq_cfg: VQVAEConfig, directory: Optional[str]) -> dict:
  """Params from a checkpoint directory written by `python -m var_models.convert var` or training."""
  abstract = jax.eval_shape(lambda k: init_var_params(var_cfg, vq_cfg, k), jax.random.key(0))
  return checkpoint.load_params(directory, abstract)


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
