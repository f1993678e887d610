"""The published settings of an accelerator, by name: one `preset` for every method, and the error
that names a bad setting."""
from __future__ import annotations

from typing import Any, ClassVar


class Presets:
  """Mixin of an accelerator class whose PRESETS maps name -> (settings, where they come from):
  `preset(name)` builds `cls(**settings, source='name: where they come from')`."""
  PRESETS: ClassVar[dict[str, tuple[dict[str, Any], str]]] = {}

  @classmethod
  def preset(cls, name: str):
    if name not in cls.PRESETS:
      raise ValueError(f'unknown {cls.__name__} preset {name!r}; known: {sorted(cls.PRESETS)}')
    settings, source = cls.PRESETS[name]
    return cls(**settings, source=f'{name}: {source}')


def setting_error(policy, field: str, message: str) -> ValueError:
  """The error of a bad static setting of an accelerator, naming it: 'FastVAR.ratios: message'."""
  return ValueError(f'{type(policy).__name__}.{field}: {message}')
