"""The converter and sampling command lines, checkpoints on disk, config validation."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from PIL import Image

from configs import var as var_configs
from test_var import official_state_dict as var_state_dict
from test_vqvae import official_state_dict as vqvae_state_dict
from var_models import checkpoint
from var_models.convert.__main__ import convert_var_files, main as convert_main
from var_models.convert.var import convert_var
from var_models.convert.vqvae import convert_vqvae
from var_models.tokenizers.vqvae import VQVAEConfig
from var_models.var import from_config as var_from_config
from var_models.var.model import VARConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNS = (1, 2, 3, 4)
VAR_CFG = VARConfig(depth=2, width=32, num_heads=2, num_classes=5, vocab_size=64, cvae=8, patch_nums=PNS)
VQ_CFG = VQVAEConfig(vocab_size=64, z_channels=8, ch=32, ch_mult=(1, 2), num_res_blocks=1, patch_nums=PNS)


@pytest.fixture(scope='module')
def npz_files(tmp_path_factory):
  d = tmp_path_factory.mktemp('official')
  vae, var = str(d / 'vae.npz'), str(d / 'var.npz')
  np.savez(vae, **vqvae_state_dict(VQ_CFG))
  np.savez(var, **var_state_dict(VAR_CFG))
  return vae, var


def test_converted_checkpoint_round_trips_through_disk(npz_files, tmp_path):
  vae, var = npz_files
  out = str(tmp_path / 'ckpt')
  convert_var_files(vae, var, 2, out, var_cfg=VAR_CFG, vq_cfg=VQ_CFG)
  loaded = var_from_config.load_var_params(VAR_CFG, VQ_CFG, out)
  want = {'var': convert_var(dict(np.load(var)), VAR_CFG), 'vqvae': convert_vqvae(dict(np.load(vae)), VQ_CFG)}
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, want)
  assert checkpoint.load_meta(out)['depth'] == 2


def test_convert_cli_rejects_a_depth_the_checkpoint_does_not_hold(npz_files, tmp_path):
  vae, var = npz_files
  with pytest.raises(SystemExit, match='--depth 16 but .* holds a VAR of depth 2'):
    convert_main(['var', '--vae', vae, '--var', var, '--depth', '16', '--out', str(tmp_path / 'x')])


def test_loading_a_checkpoint_of_another_model_names_the_parameter(npz_files, tmp_path):
  vae, var = npz_files
  out = str(tmp_path / 'ckpt')
  convert_var_files(vae, var, 2, out, var_cfg=VAR_CFG, vq_cfg=VQ_CFG)
  wider = VARConfig(depth=2, width=64, num_heads=2, num_classes=5, vocab_size=64, cvae=8, patch_nums=PNS)
  with pytest.raises(ValueError, match=r"parameter \['var'\]\['.*'\].* has shape"):
    var_from_config.load_var_params(wider, VQ_CFG, out)


def test_sample_cli_writes_a_png_grid_and_a_second_run_loads_the_sampler_from_the_cache(tmp_path):
  config = var_configs.get_config('tiny')
  var_cfg, vq_cfg = var_from_config.var_configs(config)
  ckpt = str(tmp_path / 'tiny')
  checkpoint.save_params(ckpt, var_from_config.init_var_params(var_cfg, vq_cfg, jax.random.key(0)))
  cache = tmp_path / 'xla'
  grids, entries = [], []
  for run in range(2):
    out = str(tmp_path / f'grid{run}.png')
    cmd = [sys.executable, '-m', 'train.sample', '--config', 'configs/var.py:tiny', '--ckpt', ckpt,
           '--out', out, '--labels', '1,2,3', '--num_images', '4', '--batch_size', '2', '--cfg', '2.0',
           '--top_k', '5', '--top_p', '0.9', '--seed', '3', f'--compilation_cache={cache}']
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=600)
    grids.append(np.asarray(Image.open(out)))
    entries.append(sorted(os.listdir(cache)))
  assert grids[0].ndim == 3 and grids[0].shape[2] == 3 and grids[0].shape[0] >= 2 * 64
  assert grids[0].std() > 0
  assert any(name.startswith('jit__sample') for name in entries[0]), entries[0]
  assert entries[1] == entries[0]   # nothing compiled again
  np.testing.assert_array_equal(grids[1], grids[0])


def test_sample_cli_rejects_bad_labels_before_sampling(tmp_path):
  cmd = [sys.executable, '-m', 'train.sample', '--config', 'configs/var.py:tiny', '--labels', '3,99',
         '--out', str(tmp_path / 'x.png')]
  res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert res.returncode != 0 and 'labels must be in [0, 10)' in res.stderr
  assert not os.path.exists(tmp_path / 'x.png')


def _portable(config):
  config.attn_backend = 'xla'  # the released configs ask for cudnn, which needs a GPU
  return config


def test_every_variant_builds_and_official_ones_match_the_checkpoints():
  for variant in var_configs.VARIANTS:
    config = var_configs.get_config(variant)
    if config.family == 'vqvae':  # the tokenizer alone, shaped like its VAR config's
      base = var_configs.get_config(variant.removeprefix('vqvae_') if '_' in variant else 'd16')
      assert var_from_config.vqvae_config(config) == var_from_config.var_configs(_portable(base))[1]
      continue
    var_cfg, vq_cfg = var_from_config.var_configs(_portable(config))
    assert var_cfg.vocab_size == vq_cfg.vocab_size
  var_cfg, vq_cfg = var_from_config.var_configs(_portable(var_configs.get_config('d24')))
  assert (var_cfg.depth, var_cfg.width, var_cfg.num_heads, vq_cfg.ch, vq_cfg.image_size) == (24, 1536, 24, 160, 256)


@pytest.mark.parametrize('key,value,message', [
    ('image_size', 512, 'config.image_size=512 does not match'),
    ('dtype', 'float8', 'config.dtype must be one of'),
    ('attn_backend', 'flash', 'config.attn_backend must be one of'),
])
def test_bad_config_values_name_the_key(key, value, message):
  config = var_configs.get_config('tiny')
  config[key] = value
  with pytest.raises(ValueError, match=message):
    var_from_config.var_configs(config)


@pytest.mark.skipif(jax.default_backend() == 'gpu', reason='cudnn is available on a GPU')
def test_cudnn_backend_without_a_gpu_is_a_clear_error():
  with pytest.raises(ValueError, match="attn_backend='cudnn' needs an NVIDIA GPU"):
    var_from_config.var_configs(var_configs.get_config('d16'))


def test_unknown_variant_is_named():
  with pytest.raises(ValueError, match="unknown VAR variant 'd17'"):
    var_configs.get_config('d17')
