"""Sample a PNG grid from a VAR or MAR config and checkpoint.

  python -m train.sample --config configs/var.py:d16 --ckpt DIR --out grid.png \
      --labels 207,360,388 --cfg 1.5 --top_k 900 --top_p 0.96 --seed 0 --batch_size 16
  python -m train.sample --config configs/mar.py:base --ckpt DIR --out grid.png \
      --labels 207,360 --cfg 2.9 --num_iter 64 --temperature 1.0

Flags left unset take the config's `sample` settings. Without --ckpt the
parameters are random (the official initialisation): useful only to check the
set-up, e.g. with a `tiny` config on a CPU.
"""
from __future__ import annotations

import numpy as np
from absl import app, flags
from ml_collections import config_flags
from tqdm import tqdm

import jax

from train import grid as grid_lib
from train import models
from var_models.mar.sampler import check_mar_sample_args, make_mar_sampler
from var_models.nn.checks import check_labels
from var_models.var.sampler import check_sample_args, make_sampler

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/{var,mar}.py:VARIANT', lock_config=True)
_CKPT = flags.DEFINE_string('ckpt', None, 'checkpoint directory (from `python -m var_models.convert`)')
_OUT = flags.DEFINE_string('out', 'samples/grid.png', 'where to write the PNG grid')
_LABELS = flags.DEFINE_list('labels', None, 'class labels, comma separated (default: 0, 1, 2, ...)')
_NUM = flags.DEFINE_integer('num_images', None, 'images in the grid (default: one per label, else batch_size)')
_CFG = flags.DEFINE_float('cfg', None, 'classifier-free guidance scale')
_SEED = flags.DEFINE_integer('seed', None, 'random seed')
_BATCH = flags.DEFINE_integer('batch_size', None, 'images per compiled call')
_TOP_K = flags.DEFINE_integer('top_k', None, 'VAR: top-k, 0 = off')
_TOP_P = flags.DEFINE_float('top_p', None, 'VAR: top-p in (0, 1], 1 = off')
_NUM_ITER = flags.DEFINE_integer('num_iter', None, 'MAR: iterations')
_TEMP = flags.DEFINE_float('temperature', None, 'MAR: diffusion temperature')
_SCHEDULE = flags.DEFINE_string('cfg_schedule', None, "MAR: 'linear' or 'constant'")
_STEPS = flags.DEFINE_integer('num_diffusion_steps', None, 'MAR: diffusion steps')

_FAMILY_FLAGS = {'var': (_TOP_K, _TOP_P), 'mar': (_NUM_ITER, _TEMP, _SCHEDULE, _STEPS)}


def _pick(flag, default):
  return default if flag.value is None else flag.value


def _labels(num_classes: int, batch: int) -> np.ndarray:
  if _LABELS.value:
    try:
      labels = np.array([int(x) for x in _LABELS.value], np.int32)
    except ValueError as e:
      raise ValueError(f'--labels must be integers, got {_LABELS.value}') from e
  else:
    labels = np.arange(_NUM.value or batch, dtype=np.int32) % num_classes
  return np.resize(labels, _NUM.value or len(labels))


def _check_family_flags(family: str) -> None:
  for other, fl in _FAMILY_FLAGS.items():
    for f in fl if other != family else ():
      if f.value is not None:
        raise ValueError(f'--{f.name} applies to {other.upper()} configs, not to config.family={family!r}')


def _var_sampler(config, key, batch):
  """(sample(params, key, labels) -> images, params) for a VAR config."""
  var_cfg, vq_cfg = models.var_configs(config)
  s = config.sample
  opts = dict(cfg=_pick(_CFG, s.cfg), top_k=_pick(_TOP_K, s.top_k), top_p=_pick(_TOP_P, s.top_p))
  check_sample_args(var_cfg, np.zeros(1, np.int32), **opts)
  params = (models.load_var_params(var_cfg, vq_cfg, _CKPT.value) if _CKPT.value
            else models.init_var_params(var_cfg, vq_cfg, key))
  sampler = make_sampler(var_cfg, vq_cfg)
  return (lambda p, k, labels: sampler(p, k, labels, **opts)[0]), params


def _mar_sampler(config, key, batch):
  """(sample(params, key, labels) -> images, params) for a MAR config."""
  mar_cfg, vae_cfg = models.mar_configs(config)
  s = config.sample
  cfg = _pick(_CFG, s.cfg)
  opts = dict(cfg=cfg, cfg_schedule=_pick(_SCHEDULE, s.cfg_schedule), temperature=_pick(_TEMP, s.temperature))
  check_mar_sample_args(mar_cfg, np.zeros(1, np.int32), guidance=cfg, guided=cfg != 1.0,
                        cfg_schedule=opts['cfg_schedule'], temperature=opts['temperature'])
  sampler = make_mar_sampler(mar_cfg, vae_cfg, num_iter=_pick(_NUM_ITER, s.num_iter), guided=cfg != 1.0,
                             num_diffusion_steps=_pick(_STEPS, s.num_diffusion_steps))
  params = (models.load_mar_params(mar_cfg, vae_cfg, _CKPT.value) if _CKPT.value
            else models.init_mar_params(mar_cfg, vae_cfg, key))
  return (lambda p, k, labels: sampler(p, k, labels, **opts)[0]), params


_BUILDERS = {'var': _var_sampler, 'mar': _mar_sampler}


def main(argv):
  del argv
  config = _CONFIG.value
  if config.family not in _BUILDERS:
    raise ValueError(f'config.family must be one of {sorted(_BUILDERS)}, got {config.family!r}')
  _check_family_flags(config.family)
  batch = _pick(_BATCH, config.sample.batch_size)
  if batch <= 0:
    raise ValueError(f'--batch_size must be positive, got {batch}')
  num_classes = config.num_classes if config.family == 'var' else config.model.class_num
  labels = _labels(num_classes, batch)
  check_labels(labels, num_classes)
  key = jax.random.key(_pick(_SEED, config.sample.seed))
  pkey, key = jax.random.split(key)
  sample, params = _BUILDERS[config.family](config, pkey, batch)
  images = []
  chunks = [labels[i:i + batch] for i in range(0, len(labels), batch)]
  for i, chunk in enumerate(tqdm(chunks, desc='sampling', unit='batch')):
    padded = np.resize(chunk, batch)  # one compiled shape for every chunk
    images.append(np.asarray(sample(params, jax.random.fold_in(key, i), padded))[:len(chunk)])
  path = grid_lib.save_grid(np.concatenate(images), _OUT.value)
  print(f'wrote {len(labels)} samples to {path}')


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
