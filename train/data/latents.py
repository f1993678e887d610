"""Pre-computed VAE posteriors (MAR's --use_cached; E-CAR on VAE latents): encode the dataset once, reuse it every epoch.

WORKDIR/latents/<source>-<split>-<size>px/ holds, per writing process p of P,
moments-p.npy [n_p, 2, h, w, 2C] float32 (the posterior mean and log-variance of
the center crop and of its mirror image) and labels-p.npy [n_p] for the examples
index = p, p + P, p + 2P, ...; meta.json is written last, when every part is
complete, and a later run (or a resumed one, with any number of hosts) reuses
them. Training draws a posterior sample from the cached moments, and the flip
picks the mirrored moments, as MAR does. A random crop cannot be cached.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from tqdm import tqdm

from train.data.transforms import preprocess

CHUNK = 64  # images per encoder call (one compiled shape; the last chunk is padded)


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _encode_part(task, source, directory: str, process: int, processes: int) -> None:
  """Writes moments-p.npy and labels-p.npy for the examples p, p + P, ... of `source`."""
  indices = np.arange(process, len(source), processes)
  size = task.image_size
  encode = jax.jit(task.moments)
  batch = jax.ShapeDtypeStruct((CHUNK, size, size, 3), jnp.uint8)
  shape = jax.eval_shape(encode, task.frozen, batch).shape[1:]
  tmp = os.path.join(directory, f'moments-{process}.tmp.npy')
  out = np.lib.format.open_memmap(tmp, mode='w+', dtype=np.float32, shape=(len(indices), 2) + shape)
  labels = np.zeros(len(indices), np.int32)
  for start in tqdm(range(0, len(indices), CHUNK), desc='encoding latents', disable=process != 0):
    rows = indices[start:start + CHUNK]
    images = np.zeros((CHUNK, size, size, 3), np.uint8)
    for i, index in enumerate(rows):
      img, labels[start + i] = source.load(int(index))
      images[i] = preprocess(img, size, 'center', False, np.random.default_rng(0))
    for flip in (0, 1):
      moments = np.asarray(encode(task.frozen, images[:, :, ::-1] if flip else images))
      out[start:start + len(rows), flip] = moments[:len(rows)]
  out.flush()
  del out
  np.save(os.path.join(directory, f'labels-{process}.npy'), labels)
  os.replace(tmp, os.path.join(directory, f'moments-{process}.npy'))


def _meta(directory: str):
  path = os.path.join(directory, 'meta.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def cached_latent_examples(config, task, source, workdir: str):
  """-> (example(index, rng) -> {'moments' [h, w, 2C], 'label'}, number of examples)."""
  d = config.data
  if task.moments is None:
    raise ValueError('config.data.cache_latents needs a VAE latent space; this model reads pixels')
  if d.crop != 'center':
    raise ValueError(f"config.data.cache_latents needs config.data.crop='center', got {d.crop!r} "
                     '(a random crop cannot be cached)')
  directory = os.path.join(os.path.abspath(workdir), 'latents', f'{d.source}-{d.split}-{task.image_size}px')
  n = len(source)
  meta = _meta(directory)
  if meta is None:
    os.makedirs(directory, exist_ok=True)
    logging.info('encoding %d examples to %s', n, directory)
    _encode_part(task, source, directory, jax.process_index(), jax.process_count())
    _sync('latents written')
    if jax.process_index() == 0:
      with open(os.path.join(directory, 'meta.json'), 'w') as f:
        json.dump({'num_examples': n, 'parts': jax.process_count()}, f)
    _sync('latents meta')
    meta = _meta(directory)
  if meta['num_examples'] != n:
    raise ValueError(f'{directory} caches {meta["num_examples"]} examples, the dataset has {n}: '
                     'delete it to encode again')
  return CachedLatents(directory, meta['parts'], d.hflip), n


class CachedLatents:
  """example(index, rng) -> {'moments' [h, w, 2C], 'label'} from the parts in `directory`.

  The arrays are memory-mapped on first use in each process: a data worker receives the
  paths, not the data.
  """

  def __init__(self, directory: str, parts: int, hflip: bool):
    self.directory, self.parts, self.hflip = directory, parts, hflip
    self._moments = self._labels = None

  def __getstate__(self) -> dict:
    return {**self.__dict__, '_moments': None, '_labels': None}

  def _open(self) -> None:
    path = lambda name, p: os.path.join(self.directory, f'{name}-{p}.npy')
    self._moments = [np.load(path('moments', p), mmap_mode='r') for p in range(self.parts)]
    self._labels = [np.load(path('labels', p)) for p in range(self.parts)]

  def __call__(self, index: int, rng: np.random.Generator) -> dict:
    if self._moments is None:
      self._open()
    part, row = index % self.parts, index // self.parts
    flip = int(self.hflip and rng.random() < 0.5)
    return {'moments': np.array(self._moments[part][row, flip]), 'label': self._labels[part][row]}
