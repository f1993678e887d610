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
from tqdm import tqdm

import jax

from sampling import compilation_cache, sampling_from_config
from sampling import flags as sf
from train import grid as grid_lib
from var_models.nn.checks import check_labels

_OUT = flags.DEFINE_string('out', 'samples/grid.png', 'where to write the PNG grid')
_LABELS = flags.DEFINE_list('labels', None, 'class labels, comma separated (default: 0, 1, 2, ...)')
_NUM = flags.DEFINE_integer('num_images', None, 'images in the grid (default: one per label, else batch_size)')
_CFG = flags.DEFINE_float('cfg', None, "classifier-free guidance scale (default: the config's sample.cfg)")


def _labels(num_classes: int, batch: int) -> np.ndarray:
  if _LABELS.value:
    labels = np.array(sf.integers(_LABELS), np.int32)
  else:
    labels = np.arange(_NUM.value or batch, dtype=np.int32) % num_classes
  return np.resize(labels, _NUM.value or len(labels))


def main(argv):
  del argv
  compilation_cache.enable(compilation_cache.COMPILATION_CACHE.value)
  config = sf.CONFIG.value
  sf.check_family(config)
  batch = sf.batch_size(config.sample.batch_size)
  key = jax.random.key(sf.pick(sf.SEED, config.sample.seed))
  pkey, key = jax.random.split(key)
  sampling = sampling_from_config(config, sf.overrides(config.family, _CFG.value))
  labels = _labels(sampling.num_classes, batch)
  check_labels(labels, sampling.num_classes)   # before the parameters load
  params, sample = sampling.load(sf.CKPT.value, pkey), sampling.make()
  images = []
  chunks = [labels[i:i + batch] for i in range(0, len(labels), batch)]
  for i, chunk in enumerate(tqdm(chunks, desc='sampling', unit='batch')):
    # One shape for every chunk; the sampler checks the labels before compiling.
    out, _ = sample(params, jax.random.fold_in(key, i), np.resize(chunk, batch), **sampling.opts)
    images.append(np.asarray(out)[:len(chunk)])
  path = grid_lib.save_grid(np.concatenate(images), _OUT.value)
  print(f'wrote {len(labels)} samples to {path}')


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
