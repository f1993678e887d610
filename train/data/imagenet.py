"""ImageNet (ILSVRC 2012) through tensorflow-datasets, read by random access (no TensorFlow needed).

The first run prepares `imagenet2012` in the array_record format under
config.data.path (tfds' data_dir; default ~/tensorflow_datasets) from the tars in
config.data.manual_dir (ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar), which
needs the `data` extra (`pip install -e '.[data]'`); later runs only read. On
several hosts, process 0 prepares while the others wait, so data_dir must be shared.
"""
from __future__ import annotations

import io
import os
import tarfile
import time

import jax
from absl import logging

NAME = 'imagenet2012'
_POLL_S = 5.0


def _tfds():
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise ImportError("config.data.source='imagenet' needs tensorflow-datasets: pip install -e '.[data]'") from e
  return tfds


def _wait_until_prepared(tfds, data_dir: str) -> None:
  """Until process 0 has prepared imagenet2012 in the shared data_dir, hours for the real one. The
  other processes wait on the file system, since a collective held open that long (NCCL's set-up
  included) may time out. Should process 0 die meanwhile, JAX's distributed runtime terminates them."""
  start = time.monotonic()
  while not tfds.builder(NAME, data_dir=data_dir or None).is_prepared():
    logging.log_every_n_seconds(logging.INFO, 'waiting for process 0 to prepare %s in %s: %.0f min so far', 600,
                                NAME, data_dir, (time.monotonic() - start) / 60)
    time.sleep(_POLL_S)


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


class ImageNet:

  def __init__(self, data_dir: str, manual_dir: str, split: str):
    tfds = _tfds()
    kwargs = dict(split=split, data_dir=data_dir or None, builder_kwargs={'file_format': 'array_record'})
    if manual_dir:
      prepare = {'download_config': tfds.download.DownloadConfig(manual_dir=manual_dir)}
      if jax.process_index() == 0:
        tfds.data_source(NAME, download=True, download_and_prepare_kwargs=prepare, **kwargs)
      else:
        _wait_until_prepared(tfds, data_dir)
      _sync('imagenet prepared')
    try:
      self.source = tfds.data_source(NAME, download=False, **kwargs)
    except Exception as e:  # tfds raises its own AssertionError / DatasetNotFoundError types
      raise ValueError(f'{NAME} split {split!r} is not prepared in config.data.path={data_dir!r}; set '
                       f'config.data.manual_dir to the directory of the ImageNet tars: {e}') from e
    self.num_classes = tfds.builder(NAME, data_dir=data_dir or None).info.features['label'].num_classes

  def __len__(self) -> int:
    return len(self.source)

  def load(self, index: int):
    """(uint8 [H, W, 3], label) of example `index`."""
    ex = self.source[index]
    return ex['image'], int(ex['label'])


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def write_manual_tars(manual_dir: str, train: dict[str, list[tuple[str, bytes]]], validation: list[bytes]) -> None:
  """A miniature ImageNet as tfds' imagenet2012 builder reads it (tests, benchmarks): `train`, {WordNet
  id: [(file name, JPEG bytes)]}, as ILSVRC2012_img_train.tar (one inner tar per class, named by its id),
  and `validation` as ILSVRC2012_img_val.tar (ILSVRC2012_val_00000001.JPEG, ...), which the builder
  always reads and labels by its own list."""
  os.makedirs(manual_dir, exist_ok=True)
  with tarfile.open(os.path.join(manual_dir, 'ILSVRC2012_img_train.tar'), 'w') as tar:
    for wnid, files in train.items():
      inner = io.BytesIO()
      with tarfile.open(fileobj=inner, mode='w') as per_class:
        for name, data in files:
          _add(per_class, name, data)
      _add(tar, f'{wnid}.tar', inner.getvalue())
  with tarfile.open(os.path.join(manual_dir, 'ILSVRC2012_img_val.tar'), 'w') as tar:
    for i, data in enumerate(validation):
      _add(tar, f'ILSVRC2012_val_{i + 1:08d}.JPEG', data)
