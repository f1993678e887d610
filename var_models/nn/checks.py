"""Checks every model family shares, run before anything compiles; each error names what is wrong.

The config keys `dtype` and `attn_backend` (for the builders that turn ml_collections configs
into model configs) and the class labels a class-conditional sampler is given.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from var_models.nn import attention as attn_lib

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


def compute_dtype(name: str) -> Any:
  """config.dtype -> the jnp dtype."""
  if name not in DTYPES:
    raise ValueError(f'config.dtype must be one of {sorted(DTYPES)}, got {name!r}')
  return DTYPES[name]


def check_attn_backend(name: str) -> None:
  """config.attn_backend is a registered backend this machine can run."""
  if name not in attn_lib.backends():
    raise ValueError(f'config.attn_backend must be one of {attn_lib.backends()}, got {name!r}')
  if name == 'cudnn' and jax.default_backend() != 'gpu':
    raise ValueError(f"config.attn_backend='cudnn' needs an NVIDIA GPU (this is {jax.default_backend()}): "
                     'pass --config.attn_backend=xla')


def check_labels(labels, num_classes: int) -> None:
  """labels must be a non-empty 1-D integer array with values in [0, num_classes)."""
  labels = np.asarray(labels)
  if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f'labels must be a non-empty 1-D integer array, got shape {labels.shape} dtype {labels.dtype}')
  bad = labels[(labels < 0) | (labels >= num_classes)]
  if bad.size:
    raise ValueError(f'labels must be in [0, {num_classes}), got {bad[:5].tolist()}')
