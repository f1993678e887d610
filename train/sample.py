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

from accel.families import family_from_config
from accel.specs import policy_from_spec
from train import grid as grid_lib
from var_models import checkpoint
from var_models.nn.checks import check_labels

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


def _overrides(family: str) -> dict:
  """The sampling flags given, as `accel.families` overrides of the config's `sample` settings."""
  steps = _STEPS if family == 'mar' else _EULER
  return dict(cfg=_CFG.value, top_k=_TOP_K.value, top_p=_TOP_P.value, num_iter=_NUM_ITER.value,
              temperature=_TEMP.value, cfg_schedule=_SCHEDULE.value, num_steps=steps.value)


def _check_checkpoint_family(family: str) -> None:
  """A checkpoint whose meta.json names another family is an error before anything loads."""
  stored = checkpoint.load_meta(_CKPT.value).get('family', family)
  if stored != family:
    raise ValueError(f'--ckpt {_CKPT.value} holds {_FAMILY_NAMES.get(stored, stored)} params (its meta.json), '
                     f'not config.family={family!r}')


def main(argv):
  del argv
  config = _CONFIG.value
  if config.family not in _FAMILY_FLAGS:
    raise ValueError(f'config.family must be one of {sorted(_FAMILY_FLAGS)}, got {config.family!r}')
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
  family = family_from_config(config, _CKPT.value, _overrides(config.family), pkey)
  sample = family.make(policy_from_spec('baseline', family.name))
  images = []
  chunks = [labels[i:i + batch] for i in range(0, len(labels), batch)]
  for i, chunk in enumerate(tqdm(chunks, desc='sampling', unit='batch')):
    args, kwargs = family.call(jax.random.fold_in(key, i), np.resize(chunk, batch))  # one shape for every chunk
    images.append(np.asarray(sample(*args, **kwargs)[0])[:len(chunk)])
  path = grid_lib.save_grid(np.concatenate(images), _OUT.value)
  print(f'wrote {len(labels)} samples to {path}')


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
