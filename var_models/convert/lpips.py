"""torchvision's VGG16 state dict + the lpips package's lin weights (torch names, NumPy arrays) ->
`LPIPS` params.

torchvision numbers the layers of `vgg16().features` in one Sequential (convs, ReLUs and
pools alike): conv{b}_{i} is features.{n}. Only the feature trunk is read; the
classifier's keys are ignored. The lin weights are the lpips package's
weights/v0.1/vgg.pth (keys lin{k}.model.1.weight, the 1 behind a Dropout).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from var_models.convert.common import StateDictReader
from var_models.tokenizers.lpips import TAP_CHANNELS, VGG16_BLOCKS


def vgg16_convs() -> list[tuple[str, int, int, int]]:
  """Per conv: (our name conv{b}_{i}, its index in torchvision's vgg16().features, in and out channels)."""
  out, n, c_in = [], 0, 3
  for b, (convs, channels) in enumerate(VGG16_BLOCKS):
    for i in range(convs):
      out.append((f'conv{b + 1}_{i + 1}', n, c_in, channels))
      n, c_in = n + 2, channels  # the conv and its ReLU
    n += 1  # the max pool after the block
  return out


def _read(what: str, state_dict: Mapping[str, np.ndarray], read, ignore=()) -> dict:
  """read(reader) -> params, with every reader error prefixed by which state dict it is about."""
  try:
    r = StateDictReader(state_dict, ignore=ignore)
    params = read(r)
    r.finish()
  except ValueError as e:
    raise ValueError(f'{what}: {e}') from e
  return params


def convert_lpips(vgg: Mapping[str, np.ndarray], lin: Mapping[str, np.ndarray]) -> dict:
  """Returns the tree to pass as {'params': tree} to `LPIPS().apply`.

  Raises ValueError naming the state dict and the key on a missing, unexpected or
  mis-shaped entry.
  """
  trunk = _read('the VGG16 state dict', vgg,
                lambda r: {name: r.conv(f'features.{n}', c_in, c_out, 3) for name, n, c_in, c_out in vgg16_convs()},
                ignore=[k for k in vgg if k.startswith('classifier.')])
  lins = _read('the LPIPS lin state dict', lin,
               lambda r: {f'lin{k}': r.conv(f'lin{k}.model.1', c, 1, 1, bias=False) for k, c in enumerate(TAP_CHANNELS)})
  return {'vgg': trunk, **lins}
