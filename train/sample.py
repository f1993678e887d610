"""Sample a PNG grid from a VAR, MAR or E-CAR config and checkpoint.

  python -m train.sample --config configs/var.py:d16 --ckpt DIR --out grid.png \
      --labels 207,360,388 --cfg 1.5 --top_k 900 --top_p 0.96 --seed 0 --batch_size 16
  python -m train.sample --config configs/mar.py:base --ckpt DIR --out grid.png \
      --labels 207,360 --cfg 2.9 --num_iter 64 --temperature 1.0
  python -m train.sample --config configs/ecar.py:B --ckpt WORKDIR --out grid.png \
      --labels 207,360 --cfg 1.5 --num_steps 250

--ckpt is a converted checkpoint or a training workdir (its exported EMA params).
E-CAR in latent space also needs its frozen VAE: --config.vae_ckpt when set
(`python -m var_models.convert sdxl-vae`), else the one the workdir exported.
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

import ecar
from train import grid as grid_lib
from var_models import checkpoint
from var_models.mar.from_config import init_mar_params, load_mar_params, mar_configs
from var_models.mar.sampler import check_mar_sample_args, make_mar_sampler
from var_models.nn.checks import check_labels
from var_models.var.from_config import init_var_params, load_var_params, var_configs
from var_models.var.sampler import check_sample_args, make_sampler

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/{var,mar,ecar}.py:VARIANT', lock_config=True)
_CKPT = flags.DEFINE_string('ckpt', None, 'checkpoint directory (from `python -m var_models.convert`) or '
                            'training workdir (`python -m train`)')
_OUT = flags.DEFINE_string('out', 'samples/grid.png', 'where to write the PNG grid')
_LABELS = flags.DEFINE_list('labels', None, 'class labels, comma separated (default: 0, 1, 2, ...)')
_NUM = flags.DEFINE_integer('num_images', None, 'images in the grid (default: one per label, else batch_size)')
_CFG = flags.DEFINE_float('cfg', None, 'classifier-free guidance scale (E-CAR: cfg_scale)')
_SEED = flags.DEFINE_integer('seed', None, 'random seed')
_BATCH = flags.DEFINE_integer('batch_size', None, 'images per compiled call')
_TOP_K = flags.DEFINE_integer('top_k', None, 'VAR: top-k, 0 = off')
_TOP_P = flags.DEFINE_float('top_p', None, 'VAR: top-p in (0, 1], 1 = off')
_NUM_ITER = flags.DEFINE_integer('num_iter', None, 'MAR: iterations')
_TEMP = flags.DEFINE_float('temperature', None, 'MAR: diffusion temperature')
_SCHEDULE = flags.DEFINE_string('cfg_schedule', None, "MAR: 'linear' or 'constant'")
_STEPS = flags.DEFINE_integer('num_diffusion_steps', None, 'MAR: diffusion steps')
_EULER = flags.DEFINE_integer('num_steps', None, 'E-CAR: Euler steps in all, split over the stages')

_FAMILY_FLAGS = {'var': (_TOP_K, _TOP_P), 'mar': (_NUM_ITER, _TEMP, _SCHEDULE, _STEPS), 'ecar': (_EULER,)}
_FAMILY_NAMES = {'var': 'VAR', 'mar': 'MAR', 'ecar': 'E-CAR'}


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
        raise ValueError(f'--{f.name} applies to {_FAMILY_NAMES[other]} configs, not to config.family={family!r}')


def _check_checkpoint_family(family: str) -> None:
  """A checkpoint whose meta.json names another family is an error before anything loads."""
  stored = checkpoint.load_meta(_CKPT.value).get('family', family)
  if stored != family:
    raise ValueError(f'--ckpt {_CKPT.value} holds {_FAMILY_NAMES.get(stored, stored)} params (its meta.json), '
                     f'not config.family={family!r}')


def _var_sampler(config, key, batch):
  """(sample(params, key, labels) -> images, params) for a VAR config."""
  var_cfg, vq_cfg = var_configs(config)
  s = config.sample
  opts = dict(cfg=_pick(_CFG, s.cfg), top_k=_pick(_TOP_K, s.top_k), top_p=_pick(_TOP_P, s.top_p))
  check_sample_args(var_cfg, np.zeros(1, np.int32), **opts)
  params = (load_var_params(var_cfg, vq_cfg, _CKPT.value) if _CKPT.value
            else init_var_params(var_cfg, vq_cfg, key))
  sampler = make_sampler(var_cfg, vq_cfg)
  return (lambda p, k, labels: sampler(p, k, labels, **opts)[0]), params


def _mar_sampler(config, key, batch):
  """(sample(params, key, labels) -> images, params) for a MAR config."""
  mar_cfg, vae_cfg = mar_configs(config)
  s = config.sample
  cfg = _pick(_CFG, s.cfg)
  opts = dict(cfg=cfg, cfg_schedule=_pick(_SCHEDULE, s.cfg_schedule), temperature=_pick(_TEMP, s.temperature))
  check_mar_sample_args(mar_cfg, np.zeros(1, np.int32), guidance=cfg, guided=cfg != 1.0,
                        cfg_schedule=opts['cfg_schedule'], temperature=opts['temperature'])
  sampler = make_mar_sampler(mar_cfg, vae_cfg, num_iter=_pick(_NUM_ITER, s.num_iter), guided=cfg != 1.0,
                             num_diffusion_steps=_pick(_STEPS, s.num_diffusion_steps))
  params = (load_mar_params(mar_cfg, vae_cfg, _CKPT.value) if _CKPT.value
            else init_mar_params(mar_cfg, vae_cfg, key))
  return (lambda p, k, labels: sampler(p, k, labels, **opts)[0]), params


def _ecar_sampler(config, key, batch):
  """(sample(params, key, labels) -> images, params) for an E-CAR config."""
  cfg = ecar.ecar_config(config)
  s = config.sample
  cfg_scale = _pick(_CFG, s.cfg_scale)
  if not np.isfinite(cfg_scale):
    raise ValueError(f'--cfg must be finite, got {cfg_scale}')
  sampler = ecar.make_sampler(cfg, num_steps=_pick(_EULER, s.num_steps))
  params = ecar.ecar_params(cfg, _CKPT.value, config.vae_ckpt, key)
  return (lambda p, k, labels: sampler(p['ecar'], p['vae'], k, labels, cfg_scale=cfg_scale)[0]), params


_BUILDERS = {'var': _var_sampler, 'mar': _mar_sampler, 'ecar': _ecar_sampler}


def main(argv):
  del argv
  config = _CONFIG.value
  if config.family not in _BUILDERS:
    raise ValueError(f'config.family must be one of {sorted(_BUILDERS)}, got {config.family!r}')
  _check_family_flags(config.family)
  if _CKPT.value:
    _check_checkpoint_family(config.family)
  batch = _pick(_BATCH, config.sample.batch_size)
  if batch <= 0:
    raise ValueError(f'--batch_size must be positive, got {batch}')
  num_classes = config.model.class_num if config.family == 'mar' else config.num_classes
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
