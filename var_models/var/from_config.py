"""VAR and its VQVAE from a configs/var.py ml_collections config (every error naming its key), and
their parameters: random (the official init) or from a checkpoint directory. `train` and
`python -m accel.compare` read configs through these.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from var_models import checkpoint
from var_models.nn import checks
from var_models.nn.init import compiled_init
from var_models.tokenizers.vqvae import VQVAE, VQVAEConfig
from var_models.var.model import VARConfig, init_params


def vqvae_config(config) -> VQVAEConfig:
  """VQVAEConfig from config.vqvae and config.patch_nums (configs/var.py); errors name the key."""
  q = config.vqvae
  try:
    vq_cfg = VQVAEConfig(vocab_size=q.vocab_size, z_channels=q.z_channels, ch=q.ch,
                         ch_mult=tuple(q.ch_mult), num_res_blocks=q.num_res_blocks, beta=q.beta,
                         quant_resi=q.quant_resi, share_quant_resi=q.share_quant_resi,
                         patch_nums=tuple(int(p) for p in config.patch_nums), dtype=checks.compute_dtype(config.dtype))
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
                        dtype=checks.compute_dtype(config.dtype))
  except ValueError as e:
    raise ValueError(f'bad config.model: {e}') from e
  return var_cfg, vq_cfg


def init_var_params(var_cfg: VARConfig, vq_cfg: VQVAEConfig, key) -> dict:
  """Random {'var', 'vqvae'} params (official init for VAR), compiled as one program
  (`init.compiled_init`)."""
  def init(key):
    k1, k2 = jax.random.split(key)
    img = jnp.zeros((1, vq_cfg.image_size, vq_cfg.image_size, 3), jnp.float32)
    return {'var': init_params(var_cfg, k1), 'vqvae': VQVAE(vq_cfg).init(k2, img)['params']}
  return compiled_init(init, key)


def load_var_params(var_cfg: VARConfig, vq_cfg: VQVAEConfig, directory: Optional[str]) -> dict:
  """Params from a checkpoint directory written by `python -m var_models.convert var` or training."""
  abstract = jax.eval_shape(lambda k: init_var_params(var_cfg, vq_cfg, k), jax.random.key(0))
  return checkpoint.load_params(directory, abstract)
