"""An image-folder dataset: one sub-folder per class, classes in sorted folder-name order."""
from __future__ import annotations

import os

import numpy as np
from PIL import Image

EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.webp', '.tif', '.tiff')


class ImageFolder:
  """Every image under root/<class>/ (recursively), sorted by path: the same order on every host."""

  def __init__(self, root: str):
    if not os.path.isdir(root):
      raise ValueError(f'config.data.path={root!r} is not a directory')
    self.classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
    if not self.classes:
      raise ValueError(f'config.data.path={root!r} has no class sub-folders')
    self.files, labels = [], []
    for label, name in enumerate(self.classes):
      for dirpath, dirnames, filenames in os.walk(os.path.join(root, name)):
        dirnames.sort()
        for f in sorted(filenames):
          if f.lower().endswith(EXTENSIONS):
            self.files.append(os.path.join(dirpath, f))
            labels.append(label)
    if not self.files:
      raise ValueError(f'config.data.path={root!r} holds no images ({", ".join(EXTENSIONS)})')
    self.labels = np.asarray(labels, np.int32)
    self.num_classes = len(self.classes)

  def __len__(self) -> int:
    return len(self.files)

  def load(self, index: int) -> tuple[Image.Image, int]:
    with Image.open(self.files[index]) as img:
      return img.convert('RGB'), int(self.labels[index])
