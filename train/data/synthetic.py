"""The built-in dataset: class-conditional coloured shapes, drawn on the fly at any resolution.

Class k is shape k mod 12 in colour (k + k // 12) mod 12, so the first 12 classes
differ in both shape and colour (up to 144 classes in all). Each example has its
own position, size, rotation, background shade and colour jitter, drawn from a
generator seeded by (seed, index): the same index is the same image on any host,
in any order.
"""
from __future__ import annotations

import numpy as np

SHAPES = ('disk', 'square', 'triangle', 'ring', 'cross', 'diamond', 'stripes', 'ellipse', 'frame',
          'two_dots', 'crescent', 'x')
COLORS = np.array([
    (0.90, 0.10, 0.10), (0.10, 0.75, 0.15), (0.15, 0.30, 0.95), (0.95, 0.85, 0.10),
    (0.85, 0.15, 0.85), (0.10, 0.85, 0.90), (1.00, 0.55, 0.00), (0.50, 0.20, 0.80),
    (0.95, 0.95, 0.95), (0.60, 0.95, 0.30), (1.00, 0.60, 0.75), (0.60, 0.70, 1.00)], np.float32)
MAX_CLASSES = len(SHAPES) * len(COLORS)


def _sdf(shape: str, x: np.ndarray, y: np.ndarray, r: float) -> np.ndarray:
  """Signed distance (approximate where exactness does not matter) of a shape of radius r."""
  d = np.hypot(x, y)
  box = np.maximum(np.abs(x), np.abs(y))
  if shape == 'disk':
    return d - r
  if shape == 'square':
    return box - 0.8 * r
  if shape == 'triangle':
    return np.maximum(-y - 0.5 * r, 0.866 * np.abs(x) + 0.5 * y - 0.5 * r)
  if shape == 'ring':
    return np.abs(d - 0.8 * r) - 0.2 * r
  if shape in ('cross', 'x'):
    if shape == 'x':
      x, y = (x - y) * 0.7071, (x + y) * 0.7071
    arm = lambda a, b: np.maximum(np.abs(a) - r, np.abs(b) - 0.25 * r)
    return np.minimum(arm(x, y), arm(y, x))
  if shape == 'diamond':
    return (np.abs(x) + np.abs(y) - r) * 0.7071
  if shape == 'stripes':
    return np.maximum(box - 0.85 * r, (np.abs(np.mod(y / r * 2.5, 1.0) - 0.5) - 0.25) * r / 2.5)
  if shape == 'ellipse':
    return (np.hypot(x / r, y / (0.45 * r)) - 1) * 0.45 * r
  if shape == 'frame':
    return np.abs(box - 0.7 * r) - 0.15 * r
  if shape == 'two_dots':
    return np.minimum(np.hypot(x - 0.5 * r, y), np.hypot(x + 0.5 * r, y)) - 0.38 * r
  if shape == 'crescent':
    return np.maximum(d - r, 0.8 * r - np.hypot(x - 0.45 * r, y))
  raise ValueError(f'unknown shape {shape!r}')


def class_factors(labels):
  """(index into SHAPES, index into COLORS) of classes (ints or int arrays); labels 0..143 give
  every (shape, colour) pair once."""
  return labels % len(SHAPES), (labels + labels // len(SHAPES)) % len(COLORS)


def class_style(label: int) -> tuple[str, np.ndarray]:
  """(shape name, RGB colour in [0, 1]) of a class."""
  if not 0 <= label < MAX_CLASSES:
    raise ValueError(f'the built-in dataset has classes 0..{MAX_CLASSES - 1}, got {label}')
  shape, colour = class_factors(label)
  return SHAPES[shape], COLORS[colour]


def render(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
  """One image of class `label`: uint8 [size, size, 3]."""
  shape, color = class_style(label)
  cx, cy = rng.uniform(-0.2, 0.2, 2)
  radius = rng.uniform(0.45, 0.65)
  angle = rng.uniform(-0.3, 0.3)
  bg = rng.uniform(0.05, 0.3) * (1 + rng.uniform(-0.2, 0.2, 3))
  fg = np.clip(color * rng.uniform(0.85, 1.1), 0, 1)
  t = (np.arange(size, dtype=np.float32) + 0.5) / size * 2 - 1
  y, x = np.meshgrid(t - cy, t - cx, indexing='ij')
  c, s = np.cos(angle), np.sin(angle)
  x, y = c * x + s * y, -s * x + c * y
  pixel = 2.0 / size
  # Coverage of each pixel by the shape, linear over one pixel of distance: anti-aliased edges.
  alpha = np.clip(0.5 - _sdf(shape, x, y, radius) / pixel, 0, 1)[..., None]
  img = alpha * fg + (1 - alpha) * bg
  return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


class SyntheticShapes:
  """`num_examples` images of `num_classes` classes (labels cycle with the index)."""

  def __init__(self, num_classes: int, image_size: int, num_examples: int, seed: int):
    if not 1 <= num_classes <= MAX_CLASSES:
      raise ValueError(f'the built-in dataset has at most {MAX_CLASSES} classes, the model has {num_classes}')
    self.num_classes, self.image_size = num_classes, image_size
    self.num_examples, self.seed = num_examples, seed

  def __len__(self) -> int:
    return self.num_examples

  def load(self, index: int) -> tuple[np.ndarray, int]:
    """(uint8 [S, S, 3], label) of example `index`."""
    label = index % self.num_classes
    return render(label, self.image_size, np.random.default_rng([self.seed, index])), label
