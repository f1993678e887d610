"""Official MAR state dict (torch names, NumPy arrays) -> `MAR` params.

The tree matches `init_params(cfg, key)` leaf for leaf: the MAE encoder/decoder under
the official names (`encoder_blocks.{i}` -> `encoder_blocks_{i}`) and the DiffLoss
denoiser (`diffloss.net.*`) under `diffloss`. The official MAR holds no buffers. Its
training checkpoints keep the weights under 'model' and the EMA ones under
'model_ema': pass either dict.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from var_models.convert.common import StateDictReader, strip_prefix
from var_models.convert.diffloss import convert_diffloss
from var_models.mar.model import MARConfig


def convert_vit_block(r: StateDictReader, prefix: str, width: int, hidden: int) -> dict:
  """A timm ViT Block (qkv with bias) at `prefix` -> `vit.Block` params."""
  return {'norm1': r.norm(f'{prefix}.norm1', width),
          'attn': {'qkv': r.linear(f'{prefix}.attn.qkv', width, 3 * width),
                   'proj': r.linear(f'{prefix}.attn.proj', width, width)},
          'norm2': r.norm(f'{prefix}.norm2', width),
          'mlp': {'fc1': r.linear(f'{prefix}.mlp.fc1', width, hidden),
                  'fc2': r.linear(f'{prefix}.mlp.fc2', hidden, width)}}


def _stack(r: StateDictReader, name: str, width: int, depth: int, cfg: MARConfig) -> dict:
  hidden = int(width * cfg.mlp_ratio)
  return {f'{name}_{i}': convert_vit_block(r, f'{name}.{i}', width, hidden) for i in range(depth)}


def convert_mar(state_dict: Mapping[str, np.ndarray], cfg: MARConfig) -> dict:
  """Returns the tree to pass as {'params': tree} to `MAR(cfg).apply` (float32 NumPy leaves).

  Accepts a 'module.' (DDP) prefix. Raises ValueError naming the key on a missing,
  unexpected or mis-shaped entry (a depth other than cfg's shows as one of these).
  """
  r = StateDictReader(strip_prefix(state_dict, 'module.'))
  ce, cd, d = cfg.encoder_embed_dim, cfg.decoder_embed_dim, cfg.token_embed_dim
  length = cfg.buffer_size + cfg.seq_len
  params = {
      'class_emb': r.embedding('class_emb', cfg.class_num, ce),
      'fake_latent': r.array('fake_latent', (1, ce)),
      'z_proj': r.linear('z_proj', d, ce),
      'z_proj_ln': r.norm('z_proj_ln', ce),
      'encoder_pos_embed_learned': r.array('encoder_pos_embed_learned', (1, length, ce)),
      **_stack(r, 'encoder_blocks', ce, cfg.encoder_depth, cfg),
      'encoder_norm': r.norm('encoder_norm', ce),
      'decoder_embed': r.linear('decoder_embed', ce, cd),
      'mask_token': r.array('mask_token', (1, 1, cd)),
      'decoder_pos_embed_learned': r.array('decoder_pos_embed_learned', (1, length, cd)),
      **_stack(r, 'decoder_blocks', cd, cfg.decoder_depth, cfg),
      'decoder_norm': r.norm('decoder_norm', cd),
      'diffusion_pos_embed_learned': r.array('diffusion_pos_embed_learned', (1, cfg.seq_len, cd)),
      'diffloss': convert_diffloss(r, cfg.diffloss_config(), prefix='diffloss.net.'),
  }
  r.finish()
  return params
