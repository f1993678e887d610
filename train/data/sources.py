"""From `config.data` to the example function the loader maps over indices."""
from __future__ import annotations

import numpy as np
from absl import logging

from train.data import synthetic
from train.data.transforms import preprocess


def image_source(config, image_size: int, num_classes: int):
  """The config's image dataset: an object with __len__ and load(index) -> (image, label)."""
  d = config.data
  if d.source == 'synthetic':
    classes = min(num_classes, synthetic.MAX_CLASSES)
    if classes < num_classes:
      logging.warning("the built-in dataset draws classes 0..%d of the model's %d", classes - 1, num_classes)
    return synthetic.SyntheticShapes(classes, image_size, d.num_examples, config.train.seed)
  if d.source == 'folder':
    from train.data.folder import ImageFolder
    source = ImageFolder(d.path)
  else:
    from train.data.imagenet import ImageNet
    source = ImageNet(d.path, d.manual_dir, d.split)
  if source.num_classes > num_classes:
    raise ValueError(f'config.data.source={d.source!r} has {source.num_classes} classes, '
                     f'the model only {num_classes}')
  return source


def image_examples(source, image_size: int, crop: str, hflip: bool):
  def example(index, rng):
    img, label = source.load(index)
    return {'image': preprocess(img, image_size, crop, hflip, rng), 'label': np.int32(label)}
  return example


def make_examples(config, task, workdir: str):
  """-> (example(index, rng) -> {name: array}, number of examples)."""
  d = config.data
  source = image_source(config, task.image_size, task.num_classes)
  if d.cache_latents:
    from train.data.latents import cached_latent_examples
    return cached_latent_examples(config, task, source, workdir)
  return image_examples(source, task.image_size, d.crop, d.hflip), len(source)
