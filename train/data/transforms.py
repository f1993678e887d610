"""Per-example preprocessing of the papers: crops to the training resolution and a flip.

Every random choice comes from the generator the loader passes, seeded by
(seed, epoch, index), so an example's crop is the same on any host, on resume.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

CROPS = ('center', 'random')
VAR_MID_RESO = 1.125  # VAR resizes the short side to 1.125 x the resolution, then crops


def _pil(img) -> Image.Image:
  return img if isinstance(img, Image.Image) else Image.fromarray(np.asarray(img, np.uint8))


def center_crop(img, size: int) -> np.ndarray:
  """ADM's center_crop_arr (MAR): halve with BOX while the short side >= 2 size, BICUBIC to the
  short side = size, then the center size x size. -> uint8 [size, size, 3]."""
  img = _pil(img).convert('RGB')
  while min(img.size) >= 2 * size:
    img = img.resize(tuple(x // 2 for x in img.size), resample=Image.BOX)
  scale = size / min(img.size)
  img = img.resize(tuple(round(x * scale) for x in img.size), resample=Image.BICUBIC)
  arr = np.asarray(img)
  top, left = (arr.shape[0] - size) // 2, (arr.shape[1] - size) // 2
  return arr[top:top + size, left:left + size]


def random_crop(img, size: int, rng: np.random.Generator) -> np.ndarray:
  """VAR's training crop: LANCZOS to the short side = round(1.125 size), then a random
  size x size window. -> uint8 [size, size, 3]."""
  img = _pil(img).convert('RGB')
  mid = round(VAR_MID_RESO * size)
  scale = mid / min(img.size)
  img = img.resize(tuple(max(mid, round(x * scale)) for x in img.size), resample=Image.LANCZOS)
  arr = np.asarray(img)
  top = int(rng.integers(0, arr.shape[0] - size + 1))
  left = int(rng.integers(0, arr.shape[1] - size + 1))
  return arr[top:top + size, left:left + size]


def preprocess(img, size: int, crop: str, hflip: bool, rng: np.random.Generator) -> np.ndarray:
  """Any RGB image (PIL or uint8 [H, W, 3]) -> uint8 [size, size, 3]."""
  if crop not in CROPS:
    raise ValueError(f'config.data.crop must be one of {CROPS}, got {crop!r}')
  out = center_crop(img, size) if crop == 'center' else random_crop(img, size, rng)
  if hflip and rng.random() < 0.5:
    out = out[:, ::-1]
  return np.ascontiguousarray(out)
