"""Sample metrics on the built-in data (train/data/synthetic.py), nothing downloaded: a small CNN
that tells the built-in shapes and colours apart, trained by the project itself, and the Frechet
distance in its feature space.

  metrics = BuiltinMetrics.load_or_train(workdir, image_size=32, num_classes=10, seed=0)
  metrics.evaluate(images, labels)  # [N, S, S, 3] in [0, 1], [N] -> {'class_accuracy', 'frechet_distance'}

The network has two heads, shape (12-way) and colour (12-way), and trains on all 144 (shape,
colour) pairs: the first 12 classes differ in colour, so a classifier of a 10-class model's
classes could ignore shapes, and the distance in its features would not see a wrong one. A
class's logit is log p(its shape) + log p(its colour). The network runs at min(S, WORK_SIZE) px:
larger images are resized first, since the shapes are plain at 32 px and training then costs the
same at any resolution. It trains on images freshly drawn at that resolution, each with its own
position, size, rotation and colour jitter, mirrored half the time (a flip changes only the
crescent, and configs train with and without flips).

WORKDIR/builtin_classifier/ holds its parameters (params.msgpack) and, in meta.json, the
resolution, seed and steps they were trained with: other settings retrain it (and drop the
reference statistics next to it). reference_{S}px_{C}classes.npz: the feature statistics of the
first REFERENCE_SIZE images of the model's own training data (its resolution, classes and seed).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import serialization

from train.data import synthetic
from train.files import atomic_savez, atomic_write
from train.metrics import Statistics, feature_statistics, frechet_distance
from var_models import checkpoint

WORK_SIZE = 32          # the network's resolution at most
TRAIN_STEPS = 600       # at 32 px ~15 s on 2 idle CPU cores, ~30 s on busy ones
BATCH = 64
LR = 3e-3
REFERENCE_SIZE = 2000   # images behind the reference statistics (features are NUM_FEATURES wide)
NUM_FEATURES = 64
_CHUNK = 500            # images per forward pass when featurising many
_STREAM = 0xC1A55       # the training images' seeds, apart from the dataset's (seed, index)
_PARAMS = 'params.msgpack'


class ShapeColourNet(nn.Module):
  """images [N, S, S, 3] in [0, 1] -> (features [N, F], shape logits [N, 12], colour logits [N, 12])."""
  widths: tuple[int, ...] = (32, 64, 128)

  @nn.compact
  def __call__(self, images: jax.Array):
    n, h, w, c = images.shape
    if max(h, w) > WORK_SIZE:
      images = jax.image.resize(images, (n, WORK_SIZE, WORK_SIZE, c), 'linear')  # antialiased
    x = images * 2.0 - 1.0
    for width in self.widths:   # strided convs: 8x faster to train on a CPU than conv + max-pool
      x = nn.relu(nn.Conv(width, (3, 3), strides=2)(x))
    # The features are taken before their ReLU: units that never fire would make the covariance singular.
    features = nn.Dense(NUM_FEATURES)(x.reshape(n, -1))
    hidden = nn.relu(features)
    return features, nn.Dense(len(synthetic.SHAPES))(hidden), nn.Dense(len(synthetic.COLORS))(hidden)


_apply = jax.jit(ShapeColourNet().apply)


def class_log_probs(shape_logits: jax.Array, colour_logits: jax.Array, num_classes: int) -> jax.Array:
  """[N, 12], [N, 12] -> [N, num_classes]: log p(class k's shape) + log p(class k's colour)."""
  shape, colour = synthetic.class_factors(np.arange(num_classes))
  return jax.nn.log_softmax(shape_logits)[:, shape] + jax.nn.log_softmax(colour_logits)[:, colour]


def draw_batch(size: int, seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
  """Training batch `step`: uint8 images [BATCH, size, size, 3] of classes drawn from all 144, labels [BATCH]."""
  rng = np.random.default_rng([seed, _STREAM, step])
  labels = rng.integers(0, synthetic.MAX_CLASSES, BATCH)
  images = np.stack([synthetic.render(int(k), size, rng) for k in labels])
  flip = rng.random(BATCH) < 0.5
  images[flip] = images[flip, :, ::-1]
  return images, labels


def train_classifier(size: int, seed: int, steps: int):
  """ShapeColourNet's params after `steps` Adam steps (warm-up, cosine decay) on fresh batches."""
  net = ShapeColourNet()
  params = net.init(jax.random.key(seed), jnp.zeros((1, size, size, 3)))['params']
  tx = optax.adam(optax.warmup_cosine_decay_schedule(0.0, LR, max(1, steps // 20), steps))

  @jax.jit
  def step(params, opt_state, images, labels):
    def loss(p):
      _, shape_logits, colour_logits = net.apply({'params': p}, images.astype(jnp.float32) / 255.0)
      shape, colour = synthetic.class_factors(labels)
      return (optax.softmax_cross_entropy_with_integer_labels(shape_logits, shape).mean()
              + optax.softmax_cross_entropy_with_integer_labels(colour_logits, colour).mean())
    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  for i in range(steps):   # the next batch is drawn while the device runs this one (async dispatch)
    params, opt_state = step(params, opt_state, *draw_batch(size, seed, i))
  return params


def _load_or_train_params(directory: str, size: int, seed: int, steps: int):
  """The classifier's params, trained once per settings. Kept in msgpack, written by this process alone:
  on many hosts only process 0 scores samples, so it cannot take part in a collective orbax save."""
  settings = {'input_size': size, 'seed': seed, 'steps': steps}
  path = os.path.join(directory, _PARAMS)
  meta = checkpoint.load_meta(directory)
  if os.path.exists(path) and {k: meta.get(k) for k in settings} == settings:
    abstract = jax.eval_shape(ShapeColourNet().init, jax.random.key(0), jnp.zeros((1, size, size, 3)))['params']
    with open(path, 'rb') as f:
      params = serialization.msgpack_restore(f.read())
    checkpoint.check_tree(abstract, params, path)
    return params
  if meta:
    logging.info('the built-in classifier in %s (%s, %s) is not the one asked for (%s): retraining', directory,
                 meta, 'params.msgpack' if os.path.exists(path) else 'no params.msgpack', settings)
  shutil.rmtree(directory, ignore_errors=True)   # its reference statistics go with it
  start = time.perf_counter()
  params = train_classifier(size, seed, steps)
  os.makedirs(directory)
  atomic_write(path, lambda f: f.write(serialization.msgpack_serialize(jax.device_get(params))))
  checkpoint.save_meta(directory, settings)   # last: its settings name complete params
  logging.info('trained the built-in classifier at %d px in %.1f s', size, time.perf_counter() - start)
  return params


def _outputs(params, images, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
  """images [N, S, S, 3] in [0, 1] -> (features [N, F], class log-probabilities [N, num_classes])."""
  features, log_probs = [], []
  for i in range(0, len(images), _CHUNK):
    f, shape_logits, colour_logits = _apply({'params': params}, jnp.asarray(images[i:i + _CHUNK], jnp.float32))
    features.append(np.asarray(f))
    log_probs.append(np.asarray(class_log_probs(shape_logits, colour_logits, num_classes)))
  return np.concatenate(features), np.concatenate(log_probs)


def _reference(path: str, params, image_size: int, num_classes: int, seed: int) -> Statistics:
  """Feature statistics of the dataset's first REFERENCE_SIZE images, cached at `path`."""
  if os.path.exists(path):
    with np.load(path) as f:
      return Statistics(f['mu'], f['sigma'])
  data = synthetic.SyntheticShapes(num_classes, image_size, REFERENCE_SIZE, seed)
  images, labels = zip(*(data.load(i) for i in range(len(data))))
  features, log_probs = _outputs(params, np.stack(images).astype(np.float32) / 255.0, num_classes)
  logging.info('built-in classifier: class accuracy %.4f on the %d reference images',
               np.mean(log_probs.argmax(1) == np.array(labels)), len(labels))
  stats = feature_statistics(features)
  atomic_savez(path, mu=stats.mu, sigma=stats.sigma)
  return stats


@dataclasses.dataclass(frozen=True)
class BuiltinMetrics:
  """Class accuracy and Frechet distance of images of a model of the built-in data's classes."""
  params: Any
  num_classes: int
  reference: Statistics

  @classmethod
  def load_or_train(cls, workdir: str, image_size: int, num_classes: int, seed: int = 0,
                    steps: Optional[int] = None) -> BuiltinMetrics:
    """The classifier (trained for `steps`, None: TRAIN_STEPS) and the reference statistics of
    SyntheticShapes(num_classes, image_size, seed), cached under workdir/builtin_classifier."""
    directory = os.path.join(os.path.abspath(workdir), 'builtin_classifier')
    params = _load_or_train_params(directory, min(image_size, WORK_SIZE), seed, steps or TRAIN_STEPS)
    path = os.path.join(directory, f'reference_{image_size}px_{num_classes}classes.npz')
    return cls(params, num_classes, _reference(path, params, image_size, num_classes, seed))

  def features(self, images) -> np.ndarray:
    """images [N, S, S, 3] in [0, 1] -> penultimate features [N, F]."""
    return _outputs(self.params, images, self.num_classes)[0]

  def logits(self, images) -> np.ndarray:
    """images [N, S, S, 3] in [0, 1] -> class log-probabilities [N, num_classes]."""
    return _outputs(self.params, images, self.num_classes)[1]

  def evaluate(self, images, labels) -> dict:
    """{'class_accuracy': the fraction classified as their label, 'frechet_distance': to the reference}."""
    features, log_probs = _outputs(self.params, images, self.num_classes)
    return {'class_accuracy': float(np.mean(log_probs.argmax(1) == np.asarray(labels))),
            'frechet_distance': frechet_distance(feature_statistics(features), self.reference)}
