"""Checking class labels before anything compiles (shared by every class-conditional sampler)."""
from __future__ import annotations

import numpy as np


def check_labels(labels, num_classes: int) -> None:
  """labels must be a non-empty 1-D integer array with values in [0, num_classes)."""
  labels = np.asarray(labels)
  if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f'labels must be a non-empty 1-D integer array, got shape {labels.shape} dtype {labels.dtype}')
  bad = labels[(labels < 0) | (labels >= num_classes)]
  if bad.size:
    raise ValueError(f'labels must be in [0, {num_classes}), got {bad[:5].tolist()}')
