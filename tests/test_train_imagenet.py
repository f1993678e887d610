"""The ImageNet path: a really prepared miniature `imagenet2012` (tests/imagenet_tars.py) read in
grain's worker processes, its preparation from the tars (where TensorFlow is installed), and tfds'
mock data for splitting over hosts (skipped where tensorflow-datasets is not installed)."""
import importlib.util

import numpy as np
import pytest

from configs import common
from imagenet_tars import FIXTURE, VALIDATION, train_files, write_tars
from train.data.imagenet import ImageNet
from train.data.loader import Loader
from train.data.sources import image_examples, image_source

tfds = pytest.importorskip('tensorflow_datasets')


def _config(path='/nonexistent/tfds', **data):
  import ml_collections
  c = ml_collections.ConfigDict()
  c.train = common.train_config()
  c.data = common.data_config(source='imagenet', path=path, **data)
  return c


def _examples(source: ImageNet) -> dict:
  """file name -> (image, label) of every example of a split."""
  return {source.source[i]['file_name'].decode(): source.load(i) for i in range(len(source))}


def test_prepared_imagenet_gives_each_training_image_with_its_class():
  source = ImageNet(FIXTURE, '', 'train')
  files = train_files()
  assert source.num_classes == 1000 and len(source) == len(files)
  for name, (image, label) in _examples(source).items():
    want, want_label = files[name]
    assert label == want_label and image.shape == want.shape and image.dtype == np.uint8
    assert np.abs(image.astype(np.float32) - want).mean() < 3.0   # JPEG quality 95 of a smooth image


def test_imagenet_batches_made_by_grain_workers_equal_those_made_in_process():
  config = _config(FIXTURE, crop='random')
  source = image_source(config, 16, 1000)
  example = image_examples(source, 16, config.data.crop, config.data.hflip)
  loader = Loader(example, len(source), global_batch=4, seed=0, steps=3, workers=2, threads=1)
  data = loader.iterator(0)
  try:
    for step in range(3):
      batch, want = next(data), loader.batch(step)
      np.testing.assert_array_equal(batch['position'], loader.local_positions(step))
      for k in ('image', 'label'):
        np.testing.assert_array_equal(batch[k], want[k])
  finally:
    data.close()


@pytest.mark.skipif(importlib.util.find_spec('tensorflow') is None,
                    reason='preparing imagenet2012 needs TensorFlow (the `data` extra)')
def test_imagenet_is_prepared_from_the_tars_as_the_test_data_was(tmp_path):
  write_tars(str(tmp_path / 'manual'))
  prepared = _examples(ImageNet(str(tmp_path / 'tfds'), str(tmp_path / 'manual'), 'train'))
  stored = _examples(ImageNet(FIXTURE, '', 'train'))
  assert sorted(prepared) == sorted(stored)
  for name, (image, label) in stored.items():
    np.testing.assert_array_equal(prepared[name][0], image)
    assert prepared[name][1] == label
  assert len(ImageNet(str(tmp_path / 'tfds'), '', 'validation')) == VALIDATION


def test_imagenet_batches_are_cropped_deterministic_and_split_over_hosts():
  with tfds.testing.mock_data(num_examples=10, policy=tfds.testing.MockPolicy.USE_CODE):
    source = image_source(_config(), 16, 1000)
    assert len(source) == 10 and source.num_classes == 1000
    example = image_examples(source, 16, 'center', True)
    loaders = [Loader(example, len(source), global_batch=4, seed=0, steps=2, process_index=i,
                      process_count=2, threads=1)
               for i in range(2)]
    whole = Loader(example, len(source), global_batch=4, seed=0, steps=2, threads=1).batch(1)
    halves = [ld.batch(1) for ld in loaders]
  assert whole['image'].shape == (4, 16, 16, 3) and whole['image'].dtype == np.uint8
  assert whole['label'].min() >= 0 and whole['label'].max() < 1000
  for k in ('image', 'label'):
    np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), whole[k])


def test_imagenet_without_prepared_data_names_the_keys():
  with pytest.raises(ValueError, match='not prepared in config.data.path=.*config.data.manual_dir'):
    image_source(_config(), 16, 1000)


def test_imagenet_has_more_classes_than_a_tiny_model():
  with tfds.testing.mock_data(num_examples=2, policy=tfds.testing.MockPolicy.USE_CODE):
    with pytest.raises(ValueError, match="source='imagenet' has 1000 classes, the model only 10"):
      image_source(_config(), 16, 10)
