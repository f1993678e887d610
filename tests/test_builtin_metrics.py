"""The built-in data's classifier and sample metrics (train/builtin_classifier.py), on a small budget."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import builtin_classifier
from train.builtin_classifier import NUM_FEATURES, WORK_SIZE, BuiltinMetrics, ShapeColourNet
from train.data import synthetic

SIZE, CLASSES, STEPS = 32, 4, 150   # the tests' level-0 CPU code trains 5x slower at 16 px (42 s against 9)


def _images(n: int, seed: int, num_classes: int = CLASSES):
  """n built-in images [n, SIZE, SIZE, 3] in [0, 1] and their labels [n]."""
  data = synthetic.SyntheticShapes(num_classes, SIZE, n, seed)
  images, labels = zip(*(data.load(i) for i in range(n)))
  return np.stack(images).astype(np.float32) / 255.0, np.array(labels)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """(workdir, BuiltinMetrics) of a classifier trained for STEPS steps; reference from seed 0."""
  workdir = str(tmp_path_factory.mktemp('builtin'))
  return workdir, BuiltinMetrics.load_or_train(workdir, SIZE, CLASSES, seed=0, steps=STEPS)


@pytest.fixture(scope='module')
def held_out():
  return _images(200, seed=1)   # another seed than the reference's and the training stream's


def test_the_classifier_names_held_out_images_and_rejects_wrong_labels(trained, held_out):
  metrics, (images, labels) = trained[1], held_out
  assert metrics.evaluate(images, labels)['class_accuracy'] >= 0.98
  assert metrics.evaluate(images, (labels + 1) % CLASSES)['class_accuracy'] <= 0.02
  assert metrics.logits(images).shape == (200, CLASSES)
  assert metrics.features(images).shape == (200, NUM_FEATURES)


def test_frechet_distance_is_small_for_built_in_images_and_large_for_noise(trained, held_out):
  metrics, (images, labels) = trained[1], held_out
  real = metrics.evaluate(images, labels)['frechet_distance']
  noise = metrics.evaluate(np.random.default_rng(0).random(images.shape), labels)['frechet_distance']
  assert 0 <= real < 0.05 * noise


def test_the_cache_is_reused_and_a_new_resolution_retrains(trained, held_out, tmp_path, monkeypatch):
  workdir, metrics = trained
  shutil.copytree(workdir, tmp_path, dirs_exist_ok=True)
  sizes = []
  train = builtin_classifier.train_classifier
  monkeypatch.setattr(builtin_classifier, 'train_classifier', lambda size, *a: sizes.append(size) or train(size, *a))

  again = BuiltinMetrics.load_or_train(str(tmp_path), SIZE, CLASSES, seed=0, steps=STEPS)
  jax.tree.map(np.testing.assert_array_equal, again.params, metrics.params)
  np.testing.assert_array_equal(again.reference.sigma, metrics.reference.sigma)
  # More classes: the same classifier (it knows all 144) and the reference of their images.
  more = BuiltinMetrics.load_or_train(str(tmp_path), SIZE, CLASSES + 2, seed=0, steps=STEPS)
  jax.tree.map(np.testing.assert_array_equal, more.params, metrics.params)
  assert not np.allclose(more.reference.mu, metrics.reference.mu)
  assert more.logits(held_out[0]).shape == (200, CLASSES + 2)
  assert sizes == []

  BuiltinMetrics.load_or_train(str(tmp_path), 8, CLASSES, seed=0, steps=2)
  assert sizes == [8]
  assert sorted(p.name for p in (tmp_path / 'builtin_classifier').glob('reference_*')) == ['reference_8px_4classes.npz']


def test_images_above_the_work_size_run_the_same_network():
  shapes = lambda size: jax.tree.map(jnp.shape, jax.eval_shape(
      ShapeColourNet().init, jax.random.key(0), jnp.zeros((2, size, size, 3)))['params'])
  assert shapes(4 * WORK_SIZE) == shapes(WORK_SIZE) != shapes(WORK_SIZE // 2)
