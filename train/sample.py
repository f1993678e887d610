"""Sample a PNG grid from a VAR config and checkpoint.

  python -m train.sample --config configs/var.py:d16 --ckpt DIR --out grid.png \
      --labels 207,360,388 --cfg 1.5 --top_k 900 --top_p 0.96 --seed 0 --batch_size 16

Without --ckpt the parameters are random (the official initialisation): useful
only to check the set-up, e.g. with the `tiny` config on a CPU.
"""
from __future__ import annotations

import numpy as np
from absl import app, flags
from ml_collections import config_flags
from tqdm import tqdm

import jax

from train import grid as grid_lib
from train import models
from var_models.var_sampler import check_sample_args, make_sampler

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/var.py:VARIANT', lock_config=True)
_CKPT = flags.DEFINE_string('ckpt', None, 'checkpoint directory (from `python -m var_models.convert var`)')
_OUT = flags.DEFINE_string('out', 'samples/var.png', 'where to write the PNG grid')
_LABELS = flags.DEFINE_list('labels', None, 'class labels, comma separated (default: 0, 1, 2, ...)')
_NUM = flags.DEFINE_integer('num_images', None, 'images in the grid (default: one per label, else batch_size)')
_CFG = flags.DEFINE_float('cfg', None, 'classifier-free guidance (default: config.sample.cfg)')
_TOP_K = flags.DEFINE_integer('top_k', None, 'top-k, 0 = off (default: config.sample.top_k)')
_TOP_P = flags.DEFINE_float('top_p', None, 'top-p in (0, 1], 1 = off (default: config.sample.top_p)')
_SEED = flags.DEFINE_integer('seed', None, 'random seed (default: config.sample.seed)')
_BATCH = flags.DEFINE_integer('batch_size', None, 'images per compiled call (default: config.sample.batch_size)')


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
  n = _NUM.value or len(labels)
  return np.resize(labels, n)


def main(argv):
  del argv
  config = _CONFIG.value
  var_cfg, vq_cfg = models.var_configs(config)
  s = config.sample
  cfg, top_k, top_p = _pick(_CFG, s.cfg), _pick(_TOP_K, s.top_k), _pick(_TOP_P, s.top_p)
  batch = _pick(_BATCH, s.batch_size)
  if batch <= 0:
    raise ValueError(f'--batch_size must be positive, got {batch}')
  labels = _labels(var_cfg.num_classes, batch)
  check_sample_args(var_cfg, labels, cfg, top_k, top_p)
  key = jax.random.key(_pick(_SEED, s.seed))
  pkey, key = jax.random.split(key)
  if _CKPT.value:
    params = models.load_var_params(var_cfg, vq_cfg, _CKPT.value)
  else:
    params = models.init_var_params(var_cfg, vq_cfg, pkey)
  sample = make_sampler(var_cfg, vq_cfg)
  images = []
  chunks = [labels[i:i + batch] for i in range(0, len(labels), batch)]
  for i, chunk in enumerate(tqdm(chunks, desc='sampling', unit='batch')):
    padded = np.resize(chunk, batch)  # one compiled shape for every chunk
    out, _ = sample(params, jax.random.fold_in(key, i), padded, cfg=cfg, top_k=top_k, top_p=top_p)
    images.append(np.asarray(out)[:len(chunk)])
  path = grid_lib.save_grid(np.concatenate(images), _OUT.value)
  print(f'wrote {len(labels)} samples to {path}')


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
