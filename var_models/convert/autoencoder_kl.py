"""Official MAR / LDM AutoencoderKL state dict (torch names, NumPy arrays) -> `AutoencoderKL` params.

MAR's kl16.ckpt wraps the state dict as {'model': ...}; `convert.__main__.load_state_dict`
unwraps it.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from var_models.convert.common import StateDictReader
from var_models.convert.vqvae import conv_decoder, conv_encoder
from var_models.tokenizers.autoencoder_kl import AutoencoderKLConfig

# LDM training checkpoints carry the loss modules (LPIPS, discriminator) under 'loss.';
# the official loader drops them (load_state_dict(strict=False) leaves them unexpected).
IGNORED_PREFIXES = ('loss.',)


def separate_qkv_attn(r: StateDictReader, prefix: str, c: int) -> dict:
  """LDM's AttnBlock: q, k, v and proj_out are separate 1x1 convs [C, C, 1, 1] -> Dense [C, C]."""
  p = {'norm': r.norm(f'{prefix}.norm', c)}
  for name in ('q', 'k', 'v', 'proj_out'):
    conv = r.conv(f'{prefix}.{name}', c, c, 1)
    p[name] = {'kernel': np.ascontiguousarray(conv['kernel'][0, 0]), 'bias': conv['bias']}
  return p


def convert_autoencoder_kl(state_dict: Mapping[str, np.ndarray], cfg: AutoencoderKLConfig) -> dict:
  """Returns the tree to pass as {'params': tree} to `AutoencoderKL(cfg).apply`.

  Raises ValueError naming the key on a missing, unexpected or mis-shaped entry.
  """
  r = StateDictReader(state_dict, ignore=[k for k in state_dict if k.startswith(IGNORED_PREFIXES)])
  cz, ce = cfg.z_channels, cfg.embed_dim
  arch = dict(ch=cfg.ch, ch_mult=tuple(cfg.ch_mult), num_res_blocks=cfg.num_res_blocks,
              using_mid_sa=cfg.mid_attn, attn=separate_qkv_attn)
  params = {
      'encoder': conv_encoder(r, 'encoder', in_channels=3, z_out=2 * cz, using_sa=cfg.encoder_attn, **arch),
      'decoder': conv_decoder(r, 'decoder', out_channels=3, z_channels=cz, using_sa=cfg.decoder_attn, **arch),
      'quant_conv': r.conv('quant_conv', 2 * cz, 2 * ce, 1),
      'post_quant_conv': r.conv('post_quant_conv', ce, cz, 1),
  }
  r.finish()
  return params
