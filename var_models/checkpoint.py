"""Parameter checkpoints on disk: an orbax tree plus a small JSON of metadata.

Restoring against an abstract tree (shapes from `jax.eval_shape` of the model's
init) turns any structure or shape mismatch into an error naming the parameter.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

_META = 'meta.json'
_PARAMS = 'params'


def save_params(directory: str, params: Any, meta: Optional[dict] = None) -> None:
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:   # on many hosts, every host calls this together
    ckptr.save(os.path.join(directory, _PARAMS), params, force=True)
  if jax.process_index() == 0:
    save_meta(directory, meta or {})


def save_meta(directory: str, meta: dict) -> None:
  """directory/meta.json, which load_meta reads (written by the calling process alone)."""
  with open(os.path.join(os.path.abspath(directory), _META), 'w') as f:
    json.dump(meta, f, indent=2, sort_keys=True)


def load_meta(directory: str) -> dict:
  path = os.path.join(os.path.abspath(directory), _META)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _paths(tree) -> dict[str, tuple]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): tuple(np.shape(x)) for p, x in flat}


def check_tree(expected, got, what: str = 'checkpoint') -> None:
  """Raises ValueError naming the first missing, unexpected or mis-shaped parameter."""
  exp, have = _paths(expected), _paths(got)
  for k in sorted(exp.keys() - have.keys()):
    raise ValueError(f'{what} is missing parameter {k} (expected shape {exp[k]})')
  for k in sorted(have.keys() - exp.keys()):
    raise ValueError(f'{what} has unexpected parameter {k} with shape {have[k]}')
  for k in sorted(exp):
    if exp[k] != have[k]:
      raise ValueError(f'{what} parameter {k} has shape {have[k]}, expected {exp[k]}')


def _restore(directory: str, check) -> Any:
  """Opens `directory`'s params checkpoint, calls check(stored metadata) -> the abstract tree to
  restore (checked against the metadata), and restores it."""
  path = os.path.join(os.path.abspath(directory), _PARAMS)
  if not os.path.isdir(path):
    raise FileNotFoundError(f'no parameter checkpoint at {path}')
  # Whole onto this process's first device, however many hosts and devices wrote the checkpoint.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  with ocp.StandardCheckpointer() as ckptr:
    stored = ckptr.metadata(path)
    target = check(getattr(stored, 'item_metadata', stored))
    return ckptr.restore(path, jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                                      sharding=device), target))


def load_params(directory: str, abstract: Any) -> Any:
  """Restores params laid out like `abstract` (arrays or ShapeDtypeStructs)."""
  def check(stored):
    check_tree(abstract, stored, f'checkpoint {directory}')
    return abstract
  return _restore(directory, check)


def load_component(directory: str, name: str, abstract: Any) -> Any:
  """One part (e.g. 'vqvae', 'vae') of a params checkpoint laid out like `abstract`.

  The checkpoint may hold other parts of any shape (a converted {'var', 'vqvae'}
  of another depth); only `name` is checked and returned.
  """
  def check(stored):
    if name not in stored:
      raise ValueError(f'checkpoint {directory} holds no {name!r} parameters (it has {sorted(stored)})')
    check_tree(abstract, stored[name], f'checkpoint {directory} [{name!r}]')
    return dict(stored)
  return _restore(directory, check)[name]
