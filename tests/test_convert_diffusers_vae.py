"""The diffusers-layout AutoencoderKL converter (SDXL VAE): same params as the LDM-layout converter, errors
naming diffusers keys, the safetensors CLI path."""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from conv_state_dicts import conv, norm, resnet
from state_dict_edits import edit as edit_state_dict, edited

from var_models import checkpoint
from var_models.convert.__main__ import main as convert_main
from var_models.convert.autoencoder_kl import convert_autoencoder_kl
from var_models.convert.diffusers_vae import convert_diffusers_vae
from var_models.tokenizers.autoencoder_kl import SDXL_F8C4, AutoencoderKLConfig

# The SDXL VAE's layout (mid-block attention only) at toy widths; z_channels != embed_dim.
CFG = dataclasses.replace(SDXL_F8C4, embed_dim=3, z_channels=4, ch=32, ch_mult=(1, 2, 2), num_res_blocks=1)


def _linear(sd, rng, name, c):
  sd[f'{name}.weight'] = (rng.normal(size=(c, c)) / np.sqrt(c)).astype(np.float32)
  sd[f'{name}.bias'] = (0.1 * rng.normal(size=(c,))).astype(np.float32)


def _mid(sd, rng, name, c, old_attention_names):
  resnet(sd, rng, f'{name}.resnets.0', c, c, shortcut='conv_shortcut')
  norm(sd, rng, f'{name}.attentions.0.group_norm', c)
  for proj in (('query', 'key', 'value', 'proj_attn') if old_attention_names else ('to_q', 'to_k', 'to_v', 'to_out.0')):
    _linear(sd, rng, f'{name}.attentions.0.{proj}', c)
  resnet(sd, rng, f'{name}.resnets.1', c, c, shortcut='conv_shortcut')


def diffusers_state_dict(cfg: AutoencoderKLConfig, seed: int = 0, old_attention_names: bool = False) -> dict:
  """Names and shapes as diffusers' AutoencoderKL (Encoder / Decoder of models/autoencoders/vae.py) builds them."""
  rng = np.random.default_rng(seed)
  sd: dict[str, np.ndarray] = {}
  chans = [cfg.ch * m for m in cfg.ch_mult]
  conv(sd, rng, 'encoder.conv_in', 3, chans[0], 3)
  c = chans[0]
  for i, out in enumerate(chans):
    for j in range(cfg.num_res_blocks):
      resnet(sd, rng, f'encoder.down_blocks.{i}.resnets.{j}', c, out, shortcut='conv_shortcut')
      c = out
    if i != len(chans) - 1:
      conv(sd, rng, f'encoder.down_blocks.{i}.downsamplers.0.conv', c, c, 3)
  _mid(sd, rng, 'encoder.mid_block', c, old_attention_names)
  norm(sd, rng, 'encoder.conv_norm_out', c)
  conv(sd, rng, 'encoder.conv_out', c, 2 * cfg.z_channels, 3)
  conv(sd, rng, 'quant_conv', 2 * cfg.z_channels, 2 * cfg.embed_dim, 1)
  conv(sd, rng, 'post_quant_conv', cfg.embed_dim, cfg.z_channels, 1)
  conv(sd, rng, 'decoder.conv_in', cfg.z_channels, chans[-1], 3)
  _mid(sd, rng, 'decoder.mid_block', chans[-1], old_attention_names)
  c = chans[-1]
  for k, out in enumerate(reversed(chans)):  # up_blocks.0 is the coarsest level
    for j in range(cfg.num_res_blocks + 1):
      resnet(sd, rng, f'decoder.up_blocks.{k}.resnets.{j}', c, out, shortcut='conv_shortcut')
      c = out
    if k != len(chans) - 1:
      conv(sd, rng, f'decoder.up_blocks.{k}.upsamplers.0.conv', c, c, 3)
  norm(sd, rng, 'decoder.conv_norm_out', c)
  conv(sd, rng, 'decoder.conv_out', c, 3, 3)
  return sd


def _ldm_name(key: str, levels: int) -> str:
  """The LDM name of a diffusers key, spelled out level by level (independently of the converter)."""
  table = {'conv_norm_out': 'norm_out', 'conv_shortcut': 'nin_shortcut', 'mid_block.resnets.0': 'mid.block_1',
           'mid_block.resnets.1': 'mid.block_2', 'mid_block.attentions.0': 'mid.attn_1', 'group_norm': 'norm',
           'to_q': 'q', 'to_k': 'k', 'to_v': 'v', 'to_out.0': 'proj_out', 'query': 'q', 'key': 'k',
           'value': 'v', 'proj_attn': 'proj_out', 'downsamplers.0': 'downsample', 'upsamplers.0': 'upsample'}
  for i in range(levels):
    table[f'encoder.down_blocks.{i}.'] = f'encoder.down.{i}.'
    table[f'decoder.up_blocks.{i}.'] = f'decoder.up.{levels - 1 - i}.'
  for old, new in table.items():
    key = key.replace(old, new)
  return key.replace('.resnets.', '.block.')


def _as_ldm(sd: dict, levels: int) -> dict:
  out = {}
  for k, v in sd.items():
    name = _ldm_name(k, levels)
    out[name] = v[:, :, None, None] if '.attn_1.' in name and v.ndim == 2 else v
  return out


@pytest.mark.parametrize('old_names', [False, True])
def test_same_params_as_the_ldm_layout(old_names):
  sd = diffusers_state_dict(CFG, old_attention_names=old_names)
  got = convert_diffusers_vae(sd, CFG)
  want = convert_autoencoder_kl(_as_ldm(sd, len(CFG.ch_mult)), CFG)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_layouts_of_reversed_up_blocks_and_linear_attention():
  sd = diffusers_state_dict(CFG)
  p = convert_diffusers_vae(sd, CFG)
  last = len(CFG.ch_mult) - 1
  np.testing.assert_array_equal(p['decoder'][f'up_{last}_block_0']['conv1']['kernel'],
                                sd['decoder.up_blocks.0.resnets.0.conv1.weight'].transpose(2, 3, 1, 0))
  np.testing.assert_array_equal(p['decoder']['up_1_upsample']['conv']['bias'],
                                sd[f'decoder.up_blocks.{last - 1}.upsamplers.0.conv.bias'])
  np.testing.assert_array_equal(p['encoder']['mid']['attn_1']['k']['kernel'],
                                sd['encoder.mid_block.attentions.0.to_k.weight'].T)
  np.testing.assert_array_equal(p['encoder']['down_1_block_0']['nin_shortcut']['kernel'][0, 0],
                                sd['encoder.down_blocks.1.resnets.0.conv_shortcut.weight'][:, :, 0, 0].T)


@pytest.mark.parametrize('how,key', [
    ('drop', 'decoder.up_blocks.0.resnets.1.norm1.bias'),
    ('drop', 'encoder.mid_block.attentions.0.to_out.0.weight'),
    ('drop', 'encoder.down_blocks.1.resnets.0.conv_shortcut.weight'),
    ('reshape', 'decoder.up_blocks.1.upsamplers.0.conv.weight'),
    ('reshape', 'post_quant_conv.bias'),
])
def test_bad_checkpoint_names_the_diffusers_key(how, key):
  sd = edit_state_dict(diffusers_state_dict(CFG), how, key)
  with pytest.raises(ValueError, match=re.escape(repr(key))):
    convert_diffusers_vae(sd, CFG)


@pytest.mark.parametrize('key', ['encoder.down_blocks.2.downsamplers.0.conv.weight',  # the last level has none
                                 'decoder.up_blocks.0.attentions.0.to_q.weight',
                                 'text_model.embeddings.weight'])
def test_unexpected_key_is_named(key):
  sd = edited(diffusers_state_dict(CFG), key, np.zeros((3, 3, 3, 3), np.float32))
  with pytest.raises(ValueError, match=re.escape(repr(key))):
    convert_diffusers_vae(sd, CFG)


def test_cli_reads_safetensors(tmp_path, monkeypatch):
  """The sdxl-vae subcommand, the toy config patched in for the SDXL one."""
  save_file = pytest.importorskip('safetensors.numpy').save_file
  from var_models.convert import __main__ as cli
  sd = diffusers_state_dict(CFG)
  save_file(sd, str(tmp_path / 'diffusion_pytorch_model.safetensors'))
  monkeypatch.setattr(cli, 'SDXL_F8C4', CFG)
  convert_main(['sdxl-vae', '--vae', str(tmp_path / 'diffusion_pytorch_model.safetensors'),
                '--out', str(tmp_path / 'ckpt')])
  abstract = {'vae': jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                            convert_diffusers_vae(sd, CFG))}
  restored = checkpoint.load_params(str(tmp_path / 'ckpt'), abstract)
  jax.tree_util.tree_map(np.testing.assert_array_equal, restored['vae'], convert_diffusers_vae(sd, CFG))
  assert checkpoint.load_meta(str(tmp_path / 'ckpt'))['model'] == 'sdxl-vae'
