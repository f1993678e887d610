"""Official VAR state dict (torch names, NumPy arrays) -> `VAR` params.

The tree matches `init_params(cfg, key)` leaf for leaf. The schedule buffers a
checkpoint may carry (lvl_1L, attn_bias_for_masking) are derived from
patch_nums here, so they are checked against the config and then dropped.
"""
from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from var_models.convert.common import StateDictReader, strip_prefix
from var_models.var.model import VARConfig

_BLOCK_KEY = re.compile(r'blocks\.(\d+)\.')


def infer_var_depth(state_dict: Mapping[str, np.ndarray]) -> int:
  """Number of transformer blocks in an official VAR state dict."""
  sd = strip_prefix(state_dict, 'module.')
  ids = {int(m.group(1)) for k in sd if (m := _BLOCK_KEY.match(k))}
  if not ids:
    raise ValueError('checkpoint has no blocks.{i}.* keys: not a VAR state dict')
  if ids != set(range(max(ids) + 1)):
    raise ValueError(f'checkpoint block indices are not 0..n-1: {sorted(ids)}')
  return len(ids)


def _check_schedule_buffers(r: StateDictReader, cfg: VARConfig) -> None:
  """A checkpoint trained on other patch_nums shows here even when L agrees."""
  sched = cfg.schedule
  levels = sched.level_ids()
  if r.has('lvl_1L'):
    got = r.array('lvl_1L', (1, sched.L))
    if not np.array_equal(got[0], levels):
      raise ValueError(f"checkpoint key 'lvl_1L' does not match patch_nums {cfg.patch_nums}")
  if r.has('attn_bias_for_masking'):
    got = r.array('attn_bias_for_masking', (1, 1, sched.L, sched.L))[0, 0]
    if not np.array_equal(got == 0, levels[:, None] >= levels[None, :]):
      raise ValueError(f"checkpoint key 'attn_bias_for_masking' does not match patch_nums {cfg.patch_nums}")


def _attention(r: StateDictReader, prefix: str, cfg: VARConfig) -> dict:
  c, h = cfg.width, cfg.num_heads
  if r.has(f'{prefix}.zero_k_bias') and np.any(r.array(f'{prefix}.zero_k_bias', (c,))):
    raise ValueError(f'checkpoint key {prefix + ".zero_k_bias"!r} is not all zeros (the model has no k bias)')
  p = {'mat_qkv': r.linear(f'{prefix}.mat_qkv', c, 3 * c, bias=False),
       'q_bias': r.array(f'{prefix}.q_bias', (c,)),
       'v_bias': r.array(f'{prefix}.v_bias', (c,)),
       'proj': r.linear(f'{prefix}.proj', c, c)}
  if cfg.attn_l2_norm:
    p['scale_mul'] = r.array(f'{prefix}.scale_mul_1H11', (1, h, 1, 1)).reshape(h)
  return p


def _block(r: StateDictReader, prefix: str, cfg: VARConfig) -> dict:
  c, hidden = cfg.width, round(cfg.width * cfg.mlp_ratio)
  p = {'attn': _attention(r, f'{prefix}.attn', cfg),
       'ffn': {'fc1': r.linear(f'{prefix}.ffn.fc1', c, hidden), 'fc2': r.linear(f'{prefix}.ffn.fc2', hidden, c)}}
  if cfg.shared_aln:
    p['ada_gss'] = r.array(f'{prefix}.ada_gss', (1, 1, 6, c)).reshape(6, c)
  else:  # ada_lin is Sequential(SiLU, Linear): the Linear is child 1
    p['ada_lin'] = r.linear(f'{prefix}.ada_lin.1', c, 6 * c)
  return p


def convert_var(state_dict: Mapping[str, np.ndarray], cfg: VARConfig) -> dict:
  """Returns the tree to pass as {'params': tree} to `VAR(cfg).apply` (float32 NumPy leaves).

  Accepts a 'module.' (DDP) prefix. Raises ValueError naming the key on a missing,
  unexpected or mis-shaped entry, and when the block count differs from cfg.depth.
  """
  sd = strip_prefix(state_dict, 'module.')
  depth = infer_var_depth(sd)
  if depth != cfg.depth:
    raise ValueError(f'checkpoint has {depth} blocks (blocks.0 .. blocks.{depth - 1}), config depth is {cfg.depth}')
  r = StateDictReader(sd, ignore=('lvl_1L', 'attn_bias_for_masking'))
  _check_schedule_buffers(r, cfg)
  c, sched = cfg.width, cfg.schedule
  params = {
      'word_embed': r.linear('word_embed', cfg.cvae, c),
      'class_emb': r.embedding('class_emb', cfg.num_classes + 1, c),
      'pos_start': r.array('pos_start', (1, sched.first_l, c)),
      'pos_1LC': r.array('pos_1LC', (1, sched.L, c)),
      'lvl_embed': r.embedding('lvl_embed', sched.num_scales, c),
      'head_nm': {'ada_lin': r.linear('head_nm.ada_lin.1', c, 2 * c)},
      'head': r.linear('head', c, cfg.vocab_size),
  }
  if cfg.shared_aln:
    params['shared_ada_lin'] = r.linear('shared_ada_lin.1', c, 6 * c)
  for i in range(cfg.depth):
    params[f'blocks_{i}'] = _block(r, f'blocks.{i}', cfg)
  r.finish()
  return params
