"""Synthetic official-layout (LDM / VAR basic_vae) state dicts of the conv encoder and decoder."""
import numpy as np


def conv(sd, rng, name, c_in, c_out, k):
  sd[f'{name}.weight'] = (rng.normal(size=(c_out, c_in, k, k)) / np.sqrt(c_in * k * k)).astype(np.float32)
  sd[f'{name}.bias'] = (0.1 * rng.normal(size=(c_out,))).astype(np.float32)


def norm(sd, rng, name, c):
  sd[f'{name}.weight'] = (1 + 0.1 * rng.normal(size=(c,))).astype(np.float32)
  sd[f'{name}.bias'] = (0.1 * rng.normal(size=(c,))).astype(np.float32)


def resnet(sd, rng, name, c_in, c_out, shortcut='nin_shortcut'):
  norm(sd, rng, f'{name}.norm1', c_in)
  conv(sd, rng, f'{name}.conv1', c_in, c_out, 3)
  norm(sd, rng, f'{name}.norm2', c_out)
  conv(sd, rng, f'{name}.conv2', c_out, c_out, 3)
  if c_in != c_out:
    conv(sd, rng, f'{name}.{shortcut}', c_in, c_out, 1)


def _attn(sd, rng, name, c, fused_qkv):
  """VAR's AttnBlock has one fused `qkv` 1x1 conv; LDM's has separate q, k, v."""
  norm(sd, rng, f'{name}.norm', c)
  if fused_qkv:
    conv(sd, rng, f'{name}.qkv', c, 3 * c, 1)
  else:
    for qkv in ('q', 'k', 'v'):
      conv(sd, rng, f'{name}.{qkv}', c, c, 1)
  conv(sd, rng, f'{name}.proj_out', c, c, 1)


def _mid(sd, rng, name, c, using_attn, fused_qkv):
  resnet(sd, rng, f'{name}.block_1', c, c)
  if using_attn:
    _attn(sd, rng, f'{name}.attn_1', c, fused_qkv)
  resnet(sd, rng, f'{name}.block_2', c, c)


def encoder_decoder(sd, rng, *, ch, ch_mult, num_res_blocks, z_out, z_in, encoder_attn, decoder_attn,
                    mid_attn, fused_qkv):
  """Adds encoder.* (ending in z_out channels) and decoder.* (from z_in channels) to sd."""
  last = len(ch_mult) - 1
  conv(sd, rng, 'encoder.conv_in', 3, ch, 3)
  c = ch
  for i, m in enumerate(ch_mult):
    for j in range(num_res_blocks):
      resnet(sd, rng, f'encoder.down.{i}.block.{j}', c, ch * m)
      c = ch * m
      if i == last and encoder_attn:
        _attn(sd, rng, f'encoder.down.{i}.attn.{j}', c, fused_qkv)
    if i != last:
      conv(sd, rng, f'encoder.down.{i}.downsample.conv', c, c, 3)
  _mid(sd, rng, 'encoder.mid', c, mid_attn, fused_qkv)
  norm(sd, rng, 'encoder.norm_out', c)
  conv(sd, rng, 'encoder.conv_out', c, z_out, 3)
  conv(sd, rng, 'decoder.conv_in', z_in, c, 3)
  _mid(sd, rng, 'decoder.mid', c, mid_attn, fused_qkv)
  for i in reversed(range(len(ch_mult))):
    for j in range(num_res_blocks + 1):
      resnet(sd, rng, f'decoder.up.{i}.block.{j}', c, ch * ch_mult[i])
      c = ch * ch_mult[i]
      if i == last and decoder_attn:
        _attn(sd, rng, f'decoder.up.{i}.attn.{j}', c, fused_qkv)
    if i != 0:
      conv(sd, rng, f'decoder.up.{i}.upsample.conv', c, c, 3)
  norm(sd, rng, 'decoder.norm_out', c)
  conv(sd, rng, 'decoder.conv_out', c, 3, 3)
