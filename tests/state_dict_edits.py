"""Corrupting synthetic official state dicts, for the converters' bad-checkpoint tests."""
import numpy as np


def edited(sd: dict, key: str, value=None) -> dict:
  """A copy of sd without `key` (value None), or with sd[key] = value."""
  sd = dict(sd)
  if value is None:
    del sd[key]
  else:
    sd[key] = value
  return sd


def edit(sd: dict, how: str, key: str) -> dict:
  """'drop' the key, add it as an 'extra' conv weight, or 'reshape' it (one row short)."""
  value = {'drop': None, 'extra': lambda: np.zeros((3, 1, 1, 1), np.float32),
           'reshape': lambda: sd[key][:-1]}[how]
  return edited(sd, key, None if value is None else value())
