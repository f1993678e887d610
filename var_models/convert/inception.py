"""pytorch-fid's FID Inception state dict (torch names, NumPy arrays) -> `FIDInceptionV3` params, and
the loader of what `python -m var_models.convert inception` writes.

The released file (pt_inception-2015-12-05-6726825d.pth; torch-fidelity ships the same weights)
holds torchvision's Inception3 names: {layer}.conv.weight, {layer}.bn.{weight, bias, running_mean,
running_var}, fc.weight [1008, 2048], fc.bias. Our modules carry the same names, so each param's
torch key is its path joined by dots with the leaf renamed, and its shape is checked against the
model's own. Two entries are read by nothing: BatchNorm's num_batches_tracked (a training
counter, present in state dicts saved from a module) and fc.bias, which the IS logits leave out
(see `var_models.tokenizers.inception`).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
from flax import traverse_util

from var_models import checkpoint
from var_models.convert.common import StateDictReader
from var_models.tokenizers.inception import FIDInceptionV3, param_shapes

_TORCH_LEAF = {'kernel': 'weight', 'scale': 'weight', 'bias': 'bias', 'mean': 'running_mean', 'var': 'running_var'}
# Our axes in torch's order: conv HWIO <- OIHW, Dense [in, out] <- Linear [out, in].
_TORCH_AXES = {4: (3, 2, 0, 1), 2: (1, 0), 1: (0,)}


def torch_key(path: tuple[str, ...]) -> str:
  """('Mixed_6d', 'branch1x1', 'bn', 'mean') -> 'Mixed_6d.branch1x1.bn.running_mean'."""
  return '.'.join(path[:-1] + (_TORCH_LEAF[path[-1]],))


def convert_inception(state_dict: Mapping[str, np.ndarray]) -> dict:
  """Returns the tree to pass as {'params': tree} to `FIDInceptionV3().apply`.

  Raises ValueError naming the key on a missing, unexpected or mis-shaped entry.
  """
  ignore = [k for k in state_dict if k.endswith('.num_batches_tracked')] + ['fc.bias']
  r = StateDictReader(state_dict, ignore=ignore)
  params = {}
  for path, leaf in traverse_util.flatten_dict(param_shapes()).items():
    axes = _TORCH_AXES[len(leaf.shape)]
    x = r.array(torch_key(path), tuple(leaf.shape[a] for a in axes))
    params[path] = x.transpose(np.argsort(axes))
  r.finish()
  return traverse_util.unflatten_dict(params)


def load_inception(directory: str) -> tuple[FIDInceptionV3, dict]:
  """(model, params) from a checkpoint directory holding {'inception': params}; features of images
  [B, H, W, 3] in [0, 1] are model.apply({'params': params}, images)."""
  return FIDInceptionV3(), checkpoint.load_component(directory, 'inception', param_shapes())
