"""The ImageNet path on tfds mock data (skipped where tensorflow-datasets is not installed)."""
import numpy as np
import pytest

from configs import common
from train.data.loader import Loader
from train.data.sources import image_examples, image_source

tfds = pytest.importorskip('tensorflow_datasets')


def _config(**data):
  import ml_collections
  c = ml_collections.ConfigDict()
  c.train = common.train_config()
  c.data = common.data_config(source='imagenet', path='/nonexistent/tfds', **data)
  return c


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
