"""A diffusers-layout AutoencoderKL state dict (the SDXL VAE's `diffusion_pytorch_model.safetensors`)
-> `AutoencoderKL` params, by renaming its keys to the LDM layout and reusing `convert_autoencoder_kl`.

diffusers -> LDM names:
  {enc,dec}oder.conv_norm_out                 -> {enc,dec}oder.norm_out
  encoder.down_blocks.{i}.resnets.{j}         -> encoder.down.{i}.block.{j}
  encoder.down_blocks.{i}.downsamplers.0      -> encoder.down.{i}.downsample
  decoder.up_blocks.{k}.resnets.{j}           -> decoder.up.{L-1-k}.block.{j}   (diffusers counts
  decoder.up_blocks.{k}.upsamplers.0          -> decoder.up.{L-1-k}.upsample     from the coarsest level)
  *.mid_block.resnets.{0,1}                   -> *.mid.block_{1,2}
  *.mid_block.attentions.0                    -> *.mid.attn_1
  resnet conv_shortcut                        -> nin_shortcut
  attention group_norm, to_q, to_k, to_v, to_out.0 (or the older query, key, value, proj_attn)
                                              -> norm, q, k, v, proj_out
Attention projections are Linear [C, C] in diffusers (1x1 convs in LDM); either
form is accepted. Errors name the diffusers key.
"""
from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from var_models.convert.autoencoder_kl import convert_autoencoder_kl
from var_models.tokenizers.autoencoder_kl import AutoencoderKLConfig

_ATTN = {'group_norm': 'norm', 'to_q': 'q', 'to_k': 'k', 'to_v': 'v', 'to_out.0': 'proj_out',
         'query': 'q', 'key': 'k', 'value': 'v', 'proj_attn': 'proj_out'}
_RESNET = {'norm1': 'norm1', 'conv1': 'conv1', 'norm2': 'norm2', 'conv2': 'conv2', 'conv_shortcut': 'nin_shortcut'}
_PARAM = r'\.(weight|bias)$'
_LAYER = {'resnet': '(' + '|'.join(_RESNET) + ')', 'attn': '(' + '|'.join(re.escape(k) for k in _ATTN) + ')'}


def _rules(levels: int):
  """(pattern, rename(match) -> LDM key) pairs over full diffusers keys."""
  res, attn = _LAYER['resnet'], _LAYER['attn']
  up = lambda k: levels - 1 - int(k)
  return [
      (rf'^(quant_conv|post_quant_conv|(?:en|de)coder\.conv_in|(?:en|de)coder\.conv_out){_PARAM}',
       lambda m: f'{m[1]}.{m[2]}'),
      (rf'^((?:en|de)coder)\.conv_norm_out{_PARAM}', lambda m: f'{m[1]}.norm_out.{m[2]}'),
      (rf'^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.{res}{_PARAM}',
       lambda m: f'encoder.down.{m[1]}.block.{m[2]}.{_RESNET[m[3]]}.{m[4]}'),
      (rf'^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv{_PARAM}',
       lambda m: f'encoder.down.{m[1]}.downsample.conv.{m[2]}'),
      (rf'^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.{res}{_PARAM}',
       lambda m: f'decoder.up.{up(m[1])}.block.{m[2]}.{_RESNET[m[3]]}.{m[4]}'),
      (rf'^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv{_PARAM}',
       lambda m: f'decoder.up.{up(m[1])}.upsample.conv.{m[2]}'),
      (rf'^((?:en|de)coder)\.mid_block\.resnets\.([01])\.{res}{_PARAM}',
       lambda m: f'{m[1]}.mid.block_{int(m[2]) + 1}.{_RESNET[m[3]]}.{m[4]}'),
      (rf'^((?:en|de)coder)\.mid_block\.attentions\.0\.{attn}{_PARAM}',
       lambda m: f'{m[1]}.mid.attn_1.{_ATTN[m[2]]}.{m[3]}'),
  ]


def to_ldm_names(state_dict: Mapping[str, np.ndarray], levels: int) -> tuple[dict, dict]:
  """(LDM-named state dict, {LDM key: diffusers key}). Linear attention weights become 1x1 convs.
  A key no rule knows, or two keys landing on one LDM key, is a ValueError naming it."""
  rules = [(re.compile(p), f) for p, f in _rules(levels)]
  out, origin = {}, {}
  for key, value in state_dict.items():
    match = next(((m, f) for p, f in rules if (m := p.match(key))), None)
    if match is None:
      raise ValueError(f'checkpoint has unexpected key {key!r} {tuple(np.shape(value))} '
                       '(not part of a diffusers AutoencoderKL)')
    ldm = match[1](match[0])
    if ldm in origin:
      raise ValueError(f'checkpoint keys {origin[ldm]!r} and {key!r} are the same parameter')
    value = np.asarray(value)
    if '.mid.attn_1.' in ldm and not ldm.endswith(('norm.weight', 'norm.bias')) and value.ndim == 2:
      value = value[:, :, None, None]
    out[ldm], origin[ldm] = value, key
  return out, origin


_LDM_ATTN = {'norm': 'group_norm', 'q': 'to_q', 'k': 'to_k', 'v': 'to_v', 'proj_out': 'to_out.0'}


def to_diffusers_name(ldm_key: str, levels: int) -> str:
  """The diffusers key (new-style attention names) of an LDM key: names a key the checkpoint lacks."""
  up = lambda i: levels - 1 - int(i)
  rules = [
      (r'^((?:en|de)coder)\.norm_out\.(.*)$', lambda m: f'{m[1]}.conv_norm_out.{m[2]}'),
      (r'^encoder\.down\.(\d+)\.block\.(\d+)\.(.*)$', lambda m: f'encoder.down_blocks.{m[1]}.resnets.{m[2]}.{m[3]}'),
      (r'^encoder\.down\.(\d+)\.downsample\.(.*)$', lambda m: f'encoder.down_blocks.{m[1]}.downsamplers.0.{m[2]}'),
      (r'^decoder\.up\.(\d+)\.block\.(\d+)\.(.*)$', lambda m: f'decoder.up_blocks.{up(m[1])}.resnets.{m[2]}.{m[3]}'),
      (r'^decoder\.up\.(\d+)\.upsample\.(.*)$', lambda m: f'decoder.up_blocks.{up(m[1])}.upsamplers.0.{m[2]}'),
      (r'^((?:en|de)coder)\.mid\.block_([12])\.(.*)$', lambda m: f'{m[1]}.mid_block.resnets.{int(m[2]) - 1}.{m[3]}'),
      (r'^((?:en|de)coder)\.mid\.attn_1\.(\w+)\.(.*)$',
       lambda m: f'{m[1]}.mid_block.attentions.0.{_LDM_ATTN.get(m[2], m[2])}.{m[3]}'),
  ]
  for pattern, rename in rules:
    if m := re.match(pattern, ldm_key):
      return rename(m).replace('.nin_shortcut.', '.conv_shortcut.')
  return ldm_key


def convert_diffusers_vae(state_dict: Mapping[str, np.ndarray], cfg: AutoencoderKLConfig) -> dict:
  """Returns the tree to pass as {'params': tree} to `AutoencoderKL(cfg).apply` (cfg e.g. SDXL_F8C4).

  Raises ValueError naming the diffusers key on a missing, unexpected or mis-shaped entry.
  """
  levels = len(cfg.ch_mult)
  ldm, origin = to_ldm_names(state_dict, levels)
  try:
    return convert_autoencoder_kl(ldm, cfg)
  except ValueError as e:
    # The LDM converter quotes LDM keys: name the diffusers ones instead.
    name = lambda m: repr(origin.get(m[1]) or to_diffusers_name(m[1], levels))
    raise ValueError(re.sub(r"'([^']+)'", name, str(e))) from None
