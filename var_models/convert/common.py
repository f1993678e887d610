"""Reading PyTorch state dicts (as NumPy arrays) into flax param trees.

Every key is consumed exactly once; `finish()` names whatever is left, so a
checkpoint with missing, unexpected or mis-shaped keys fails loudly.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import numpy as np


class StateDictReader:
  """Consumes `state_dict` (name -> array) key by key, checking shapes."""

  def __init__(self, state_dict: Mapping[str, np.ndarray], *, ignore: Iterable[str] = ()):
    self._sd = {k: np.asarray(v) for k, v in state_dict.items()}
    self._left = set(self._sd) - set(ignore)

  def array(self, key: str, shape: Optional[tuple[int, ...]] = None) -> np.ndarray:
    if key not in self._sd:
      raise ValueError(f'checkpoint is missing key {key!r}' + (f' (expected shape {shape})' if shape else ''))
    x = self._sd[key]
    if shape is not None and tuple(x.shape) != tuple(shape):
      raise ValueError(f'checkpoint key {key!r} has shape {tuple(x.shape)}, expected {tuple(shape)}')
    self._left.discard(key)
    return x.astype(np.float32) if np.issubdtype(x.dtype, np.floating) else x

  def has(self, key: str) -> bool:
    return key in self._sd

  def linear(self, prefix: str, d_in: int, d_out: int, bias: bool = True) -> dict:
    """torch Linear [out, in] -> flax Dense {'kernel': [in, out], 'bias': [out]}."""
    p = {'kernel': self.array(f'{prefix}.weight', (d_out, d_in)).T}
    if bias:
      p['bias'] = self.array(f'{prefix}.bias', (d_out,))
    return p

  def conv(self, prefix: str, c_in: int, c_out: int, k: int, bias: bool = True) -> dict:
    """torch Conv2d OIHW -> flax Conv HWIO."""
    p = {'kernel': self.array(f'{prefix}.weight', (c_out, c_in, k, k)).transpose(2, 3, 1, 0)}
    if bias:
      p['bias'] = self.array(f'{prefix}.bias', (c_out,))
    return p

  def norm(self, prefix: str, c: int) -> dict:
    """torch LayerNorm/GroupNorm affine -> flax {'scale', 'bias'}."""
    return {'scale': self.array(f'{prefix}.weight', (c,)), 'bias': self.array(f'{prefix}.bias', (c,))}

  def embedding(self, prefix: str, n: int, d: int) -> dict:
    return {'embedding': self.array(f'{prefix}.weight', (n, d))}

  def finish(self) -> None:
    if self._left:
      keys = sorted(self._left)
      shown = ', '.join(f'{k!r} {tuple(self._sd[k].shape)}' for k in keys[:10])
      raise ValueError(f'checkpoint has {len(keys)} unexpected key(s): {shown}'
                       + (' ...' if len(keys) > 10 else ''))


def strip_prefix(state_dict: Mapping[str, np.ndarray], prefix: str) -> dict:
  """Drops a wrapper prefix such as 'module.' (DDP) where every key has it."""
  if state_dict and all(k.startswith(prefix) for k in state_dict):
    return {k[len(prefix):]: v for k, v in state_dict.items()}
  return dict(state_dict)
