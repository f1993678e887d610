"""E-CAR through the sampling command line: a training workdir's export, the frozen VAE, clear errors."""
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from PIL import Image

import ecar
from ecar.model import abstract_params
from test_train_families import small_ecar
from train.tasks import random_stand_in
from train.trainer import Trainer
from var_models import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _latent():
  """small_ecar on the latents of a VAE of one downsampling (16 px images, latent grids 4 and 8)."""
  c = small_ecar()
  c.image_size, c.latent_space = 16, 'vae'
  c.vae.update(ch=32, ch_mult=(1, 2), num_res_blocks=1, mid_attn=False)
  return c


def _sample(config, *args):
  """`python -m train.sample` on configs/ecar.py:tiny with overrides that make its model `config`'s."""
  overrides = {'image_size': config.image_size, 'latent_space': config.latent_space,
               **{f'model.{k}': v for k, v in config.model.items()}, **{f'vae.{k}': v for k, v in config.vae.items()}}
  cmd = [sys.executable, '-m', 'train.sample', '--config', 'configs/ecar.py:tiny',
         *(f'--config.{k}={v}' for k, v in overrides.items()), *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
  """workdir: a training workdir's export (pixel space, the trainer's own export of its initial EMA);
  latent: {'ecar'} alone of the `_latent` model; vae: {'vae'} as `convert sdxl-vae` writes it; var: a
  VAR checkpoint."""
  d = {name: str(tmp_path_factory.mktemp(name)) for name in ('workdir', 'latent', 'vae', 'var')}
  trainer = Trainer(small_ecar(), d['workdir'])
  trainer.export()
  trainer.ckpts.close()
  trainer.summaries.close()
  cfg = ecar.ecar_config(_latent())
  checkpoint.save_params(d['latent'], {'ecar': random_stand_in(abstract_params(cfg), 0)}, {'family': 'ecar'})
  vae = random_stand_in(jax.eval_shape(lambda k: ecar.init_vae_params(cfg, k), jax.random.key(0)), 1)
  checkpoint.save_params(d['vae'], {'vae': vae}, {'family': 'ecar', 'model': 'sdxl-vae'})
  checkpoint.save_params(d['var'], {'var': {'w': np.zeros(2, np.float32)}}, {'family': 'var'})
  return d


def _assert_a_colour_grid(path):
  grid = np.asarray(Image.open(path))
  assert grid.ndim == 3 and grid.shape[2] == 3 and grid.std() > 0


def test_sample_cli_writes_a_grid_from_a_training_workdir(dirs, tmp_path):
  out = str(tmp_path / 'grid.png')
  res = _sample(small_ecar(), '--ckpt', dirs['workdir'], '--out', out, '--labels', '1,2,3', '--num_images', '4',
                '--batch_size', '2', '--cfg', '2.0', '--num_steps', '3', '--seed', '1')
  assert res.returncode == 0, res.stderr
  _assert_a_colour_grid(out)


def test_latent_space_samples_with_the_vae_of_config_vae_ckpt_and_the_sample_settings(dirs, tmp_path):
  out = str(tmp_path / 'grid.png')
  res = _sample(_latent(), f'--config.vae_ckpt={dirs["vae"]}', '--config.sample.num_steps=2',
                '--config.sample.batch_size=2', '--ckpt', dirs['latent'], '--out', out, '--labels', '4,5')
  assert res.returncode == 0, res.stderr
  _assert_a_colour_grid(out)


def _deeper():
  c = small_ecar()
  c.model.ar_depth = 2
  return c


@pytest.mark.parametrize('config, ckpt, flags, message', [
    (small_ecar, 'workdir', ['--labels', '3,10'], r'labels must be in \[0, 10\)'),
    (small_ecar, 'nothing', [], 'no parameter checkpoint at .*nothing/params'),
    (_deeper, 'workdir', [], r"\['ecar'\] is missing parameter \['ar'\]\['blocks_1'\]"),
    (small_ecar, 'var', [], r'holds VAR params \(its meta.json\), not config.family=.ecar.'),
    (_latent, 'latent', [], "holds no 'vae' parameters .*needs its frozen VAE: --config.vae_ckpt"),
    (small_ecar, 'workdir', ['--top_k', '5'], '--top_k applies to VAR configs'),
], ids=['bad_labels', 'missing', 'deeper_model', 'var_checkpoint', 'latent_without_vae', 'var_flag'])
def test_bad_labels_flags_and_checkpoints_are_errors_before_sampling(dirs, tmp_path, config, ckpt, flags, message):
  res = _sample(config(), '--ckpt', dirs.get(ckpt, str(tmp_path / ckpt)), '--out', str(tmp_path / 'x.png'), *flags)
  assert res.returncode != 0 and re.search(message, res.stderr), res.stderr[-2000:]
  assert not os.path.exists(tmp_path / 'x.png')
