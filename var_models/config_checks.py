"""Checks of the config keys every model family shares (`dtype`, `attn_backend`), for the
builders that turn ml_collections configs into model configs; each error names its key."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from var_models import attention as attn_lib

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
