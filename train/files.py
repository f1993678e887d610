"""Files that a reader never sees half-written: written under a temporary name, then renamed."""
from __future__ import annotations

import os
from typing import Any, Callable, IO

import numpy as np


def atomic_write(path: str, write: Callable[[IO[Any]], None], mode: str = 'wb') -> None:
  """write(file) to path's temporary sibling, then renamed to `path`."""
  tmp = os.path.join(os.path.dirname(path), f'.{os.path.basename(path)}.tmp')
  with open(tmp, mode) as f:
    write(f)
  os.replace(tmp, path)


def atomic_savez(path: str, **arrays) -> None:
  atomic_write(path, lambda f: np.savez(f, **arrays))
