"""PNG grids of sample images."""
from __future__ import annotations

import math
import os

import numpy as np
from PIL import Image


def make_grid(images: np.ndarray, ncol: int | None = None, pad: int = 2, min_cell: int = 64) -> np.ndarray:
  """images [N, H, W, 3] in [0, 1] -> uint8 grid; small images are upscaled (nearest) to >= min_cell."""
  images = np.asarray(images, np.float32)
  if images.ndim != 4 or images.shape[-1] != 3:
    raise ValueError(f'make_grid expects [N, H, W, 3], got {images.shape}')
  n, h, w, _ = images.shape
  up = max(1, math.ceil(min_cell / max(h, w)))
  images = images.repeat(up, axis=1).repeat(up, axis=2)
  h, w = h * up, w * up
  ncol = ncol or math.ceil(math.sqrt(n))
  nrow = math.ceil(n / ncol)
  grid = np.ones((nrow * (h + pad) + pad, ncol * (w + pad) + pad, 3), np.float32)
  for i, img in enumerate(images):
    r, c = divmod(i, ncol)
    grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = img
  return (np.clip(grid, 0, 1) * 255 + 0.5).astype(np.uint8)


def save_grid(images: np.ndarray, path: str, ncol: int | None = None) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  Image.fromarray(make_grid(images, ncol)).save(path)
  return path
