"""MAR through the command lines: conversion to disk, the sampling CLI, config validation."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from PIL import Image

from configs import mar as mar_configs_mod
from test_autoencoder_kl import official_state_dict as vae_state_dict
from test_mar import official_state_dict as mar_state_dict
from var_models.mar import from_config as models
from var_models import checkpoint
from var_models.convert.__main__ import convert_mar_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def tiny_cfgs():
  return models.mar_configs(mar_configs_mod.get_config('tiny'))


def test_mar_checkpoint_converts_with_ema_weights_and_loads(tiny_cfgs, tmp_path):
  mar_cfg, vae_cfg = tiny_cfgs
  vae_sd, mar_sd = vae_state_dict(vae_cfg), mar_state_dict(mar_cfg)
  ema_sd = {k: v + 1.0 for k, v in mar_sd.items()}
  vae, mar = str(tmp_path / 'vae.npz'), str(tmp_path / 'mar.npz')
  np.savez(vae, **vae_sd)
  np.savez(mar, **ema_sd)
  out = str(tmp_path / 'ckpt')
  convert_mar_files(vae, mar, 'tiny', out, mar_cfg=mar_cfg, vae_cfg=vae_cfg)
  loaded = models.load_mar_params(mar_cfg, vae_cfg, out)
  np.testing.assert_array_equal(loaded['mar']['fake_latent'], ema_sd['fake_latent'])
  assert checkpoint.load_meta(out)['family'] == 'mar'


def test_sample_cli_writes_a_mar_grid(tiny_cfgs, tmp_path):
  mar_cfg, vae_cfg = tiny_cfgs
  ckpt = str(tmp_path / 'tiny')
  checkpoint.save_params(ckpt, models.init_mar_params(mar_cfg, vae_cfg, jax.random.key(0)))
  out = str(tmp_path / 'grid.png')
  cmd = [sys.executable, '-m', 'train.sample', '--config', 'configs/mar.py:tiny', '--ckpt', ckpt, '--out', out,
         '--labels', '1,2', '--num_iter', '4', '--cfg', '2.0', '--cfg_schedule', 'constant', '--temperature', '0.9',
         '--num_diffusion_steps', '5']
  subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=600)
  grid = np.asarray(Image.open(out))
  assert grid.shape[2] == 3 and grid.std() > 0


def test_sample_cli_rejects_flags_of_the_other_family(tmp_path):
  cmd = [sys.executable, '-m', 'train.sample', '--config', 'configs/mar.py:tiny', '--top_k', '5',
         '--out', str(tmp_path / 'x.png')]
  res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert res.returncode != 0 and '--top_k applies to VAR configs' in res.stderr


def test_mismatched_vae_is_named_in_the_error():
  config = mar_configs_mod.get_config('tiny')
  config.vae.ch_mult = (1, 2)
  with pytest.raises(ValueError, match='config.model.vae_stride=8'):
    models.mar_configs(config)


def test_every_mar_variant_builds():
  for variant in mar_configs_mod.VARIANTS:
    config = mar_configs_mod.get_config(variant)
    config.attn_backend = 'xla'  # the released configs ask for cudnn, which needs a GPU
    mar_cfg, vae_cfg = models.mar_configs(config)
    assert mar_cfg.seq_len == (mar_cfg.img_size // vae_cfg.downsample) ** 2
