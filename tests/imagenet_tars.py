"""A miniature ImageNet as the tfds `imagenet2012` builder wants it in config.data.manual_dir:
ILSVRC2012_img_train.tar (one inner tar of JPEGs per class, named by its WordNet id) and
ILSVRC2012_img_val.tar (JPEGs named ILSVRC2012_val_NNNNNNNN.JPEG, labelled by tfds' own list).

`tests/data/tfds` holds what the builder (tfds 4.9, imagenet2012 5.1.0, array_record) made of
these tars, so that CI, which has no TensorFlow, reads a really prepared dataset. Preparing needs
the `data` extra; to make it again:

  python -m tests.imagenet_tars tests/data/tfds
"""
from __future__ import annotations

import io
import os
import sys

import numpy as np
from PIL import Image

from train.data.imagenet import ImageNet, write_manual_tars

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'tfds')
WNIDS = ('n01440764', 'n01443537')   # classes 0 and 1 of imagenet2012's label list
SIZES = ((40, 52), (52, 40), (36, 64))   # [H, W] of each class's images: crops must handle both sides
VALIDATION = 2


def pixels(seed: int, size: tuple[int, int]) -> np.ndarray:
  """A smooth random image (JPEG keeps it within a few levels), uint8 [H, W, 3]."""
  rng = np.random.default_rng(seed)
  coarse = rng.uniform(0, 255, (4, 4, 3))
  return np.asarray(Image.fromarray(coarse.astype(np.uint8)).resize(size[::-1], Image.BILINEAR))


def train_files() -> dict[str, tuple[np.ndarray, int]]:
  """file name -> (pixels, label) of every training image."""
  return {f'{wnid}_{i}.JPEG': (pixels(10 * label + i, size), label)
          for label, wnid in enumerate(WNIDS) for i, size in enumerate(SIZES)}


def _jpeg(img: np.ndarray) -> bytes:
  out = io.BytesIO()
  Image.fromarray(img).save(out, 'JPEG', quality=95)
  return out.getvalue()


def write_tars(manual_dir: str) -> None:
  train = {wnid: [] for wnid in WNIDS}
  for name, (img, label) in train_files().items():
    train[WNIDS[label]].append((name, _jpeg(img)))
  write_manual_tars(manual_dir, train, [_jpeg(pixels(100 + i, SIZES[i])) for i in range(VALIDATION)])


if __name__ == '__main__':
  import tempfile

  with tempfile.TemporaryDirectory() as tmp:
    write_tars(tmp)
    ImageNet(sys.argv[1], tmp, 'train')
  print(f'prepared imagenet2012 under {sys.argv[1]}')
