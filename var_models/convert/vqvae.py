"""Official VAR VQVAE state dict (torch names, NumPy arrays) -> `VQVAE` params.

The conv encoder/decoder readers take the attention reader as an argument so
the LDM autoencoders (separate q/k/v convs) can reuse them.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from var_models.convert.common import StateDictReader
from var_models.tokenizers.vqvae import VQVAEConfig

AttnReader = Callable[[StateDictReader, str, int], dict]
IGNORED = ('quantize.ema_vocab_hit_SV',)  # usage statistics buffer, not a parameter


def _conv1x1_as_dense(r: StateDictReader, prefix: str, c_in: int, c_out: int) -> dict:
  return {'kernel': r.array(f'{prefix}.weight', (c_out, c_in, 1, 1))[:, :, 0, 0].T,
          'bias': r.array(f'{prefix}.bias', (c_out,))}


def fused_qkv_attn(r: StateDictReader, prefix: str, c: int) -> dict:
  """VAR's AttnBlock: one qkv 1x1 conv [3C, C] split (q, k, v in that order) into three Dense."""
  w = r.array(f'{prefix}.qkv.weight', (3 * c, c, 1, 1))[:, :, 0, 0]
  b = r.array(f'{prefix}.qkv.bias', (3 * c,))
  p = {'norm': r.norm(f'{prefix}.norm', c), 'proj_out': _conv1x1_as_dense(r, f'{prefix}.proj_out', c, c)}
  for i, name in enumerate('qkv'):
    p[name] = {'kernel': np.ascontiguousarray(w[i * c:(i + 1) * c].T), 'bias': b[i * c:(i + 1) * c]}
  return p


def resnet_block(r: StateDictReader, prefix: str, c_in: int, c_out: int) -> dict:
  p = {'norm1': r.norm(f'{prefix}.norm1', c_in), 'conv1': r.conv(f'{prefix}.conv1', c_in, c_out, 3),
       'norm2': r.norm(f'{prefix}.norm2', c_out), 'conv2': r.conv(f'{prefix}.conv2', c_out, c_out, 3)}
  if c_in != c_out:
    p['nin_shortcut'] = r.conv(f'{prefix}.nin_shortcut', c_in, c_out, 1)
  return p


def _mid(r: StateDictReader, prefix: str, c: int, using_attn: bool, attn: AttnReader) -> dict:
  p = {'block_1': resnet_block(r, f'{prefix}.block_1', c, c), 'block_2': resnet_block(r, f'{prefix}.block_2', c, c)}
  if using_attn:
    p['attn_1'] = attn(r, f'{prefix}.attn_1', c)
  return p


def conv_encoder(r: StateDictReader, prefix: str, *, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int,
                 in_channels: int, z_out: int, using_sa: bool, using_mid_sa: bool, attn: AttnReader) -> dict:
  """`Encoder` params from torch keys '{prefix}.down.{i}.block.{j}...'; z_out = conv_out's channels."""
  p = {'conv_in': r.conv(f'{prefix}.conv_in', in_channels, ch, 3)}
  last, c_in = len(ch_mult) - 1, ch
  for i, mult in enumerate(ch_mult):
    for j in range(num_res_blocks):
      p[f'down_{i}_block_{j}'] = resnet_block(r, f'{prefix}.down.{i}.block.{j}', c_in, ch * mult)
      c_in = ch * mult
      if i == last and using_sa:
        p[f'down_{i}_attn_{j}'] = attn(r, f'{prefix}.down.{i}.attn.{j}', c_in)
    if i != last:
      p[f'down_{i}_downsample'] = {'conv': r.conv(f'{prefix}.down.{i}.downsample.conv', c_in, c_in, 3)}
  p['mid'] = _mid(r, f'{prefix}.mid', c_in, using_mid_sa, attn)
  p['norm_out'] = r.norm(f'{prefix}.norm_out', c_in)
  p['conv_out'] = r.conv(f'{prefix}.conv_out', c_in, z_out, 3)
  return p


def conv_decoder(r: StateDictReader, prefix: str, *, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int,
                 out_channels: int, z_channels: int, using_sa: bool, using_mid_sa: bool, attn: AttnReader) -> dict:
  """`Decoder` params from torch keys '{prefix}.up.{i}.block.{j}...'."""
  last = len(ch_mult) - 1
  c_in = ch * ch_mult[last]
  p = {'conv_in': r.conv(f'{prefix}.conv_in', z_channels, c_in, 3),
       'mid': _mid(r, f'{prefix}.mid', c_in, using_mid_sa, attn)}
  for i in reversed(range(len(ch_mult))):
    for j in range(num_res_blocks + 1):
      p[f'up_{i}_block_{j}'] = resnet_block(r, f'{prefix}.up.{i}.block.{j}', c_in, ch * ch_mult[i])
      c_in = ch * ch_mult[i]
      if i == last and using_sa:
        p[f'up_{i}_attn_{j}'] = attn(r, f'{prefix}.up.{i}.attn.{j}', c_in)
    if i != 0:
      p[f'up_{i}_upsample'] = {'conv': r.conv(f'{prefix}.up.{i}.upsample.conv', c_in, c_in, 3)}
  p['norm_out'] = r.norm(f'{prefix}.norm_out', c_in)
  p['conv_out'] = r.conv(f'{prefix}.conv_out', c_in, out_channels, 3)
  return p


def _phi_prefixes(cfg: VQVAEConfig) -> list[str]:
  """torch names of the phi convs: PhiNonShared / PhiShared / PhiPartiallyShared."""
  if cfg.share_quant_resi == 0:
    return [f'quantize.quant_resi.{k}' for k in range(cfg.num_phis)]
  if cfg.share_quant_resi == 1:
    return ['quantize.quant_resi.qresi'] * cfg.num_phis
  return [f'quantize.quant_resi.qresi_ls.{k}' for k in range(cfg.num_phis)]


def convert_vqvae(state_dict: Mapping[str, np.ndarray], cfg: VQVAEConfig) -> dict:
  """Returns the tree to pass as {'params': tree} to `VQVAE(cfg).apply`.

  Raises ValueError naming the key on a missing, unexpected or mis-shaped entry.
  """
  r = StateDictReader(state_dict, ignore=IGNORED)
  cz, ks = cfg.z_channels, cfg.quant_conv_ks
  arch = dict(ch=cfg.ch, ch_mult=tuple(cfg.ch_mult), num_res_blocks=cfg.num_res_blocks,
              using_sa=cfg.using_sa, using_mid_sa=cfg.using_mid_sa, attn=fused_qkv_attn)
  params = {
      'encoder': conv_encoder(r, 'encoder', in_channels=3, z_out=cz, **arch),
      'decoder': conv_decoder(r, 'decoder', out_channels=3, z_channels=cz, **arch),
      'quant_conv': r.conv('quant_conv', cz, cz, ks),
      'post_quant_conv': r.conv('post_quant_conv', cz, cz, ks),
      'embedding': r.embedding('quantize.embedding', cfg.vocab_size, cz),
  }
  for k, prefix in enumerate(_phi_prefixes(cfg)):
    params[f'quant_resi_{k}'] = {'conv': r.conv(prefix, cz, cz, 3)}
  r.finish()
  return params
