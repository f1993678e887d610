"""Scale schedules of next-scale models: token counts, offsets and level ids.

A schedule is static (fixed at trace time): every shape in the samplers and
the scale-causal masks derives from it.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class ScaleSchedule:
  """Square token maps of side `patch_nums[k]` at scale k, coarse to fine."""
  patch_nums: tuple[int, ...]

  def __post_init__(self):
    pns = tuple(int(p) for p in self.patch_nums)
    if not pns or any(p <= 0 for p in pns):
      raise ValueError(f'patch_nums must be positive ints, got {self.patch_nums}')
    if any(a >= b for a, b in zip(pns, pns[1:])):
      raise ValueError(f'patch_nums must increase strictly, got {pns}')
    object.__setattr__(self, 'patch_nums', pns)

  @property
  def num_scales(self) -> int:
    return len(self.patch_nums)

  @property
  def lengths(self) -> tuple[int, ...]:
    """Tokens per scale, pn * pn."""
    return tuple(p * p for p in self.patch_nums)

  @property
  def L(self) -> int:
    return sum(self.lengths)

  @property
  def first_l(self) -> int:
    return self.lengths[0]

  @property
  def begin_ends(self) -> tuple[tuple[int, int], ...]:
    """(begin, end) token offsets of each scale in the flat sequence."""
    ends = np.cumsum(self.lengths)
    return tuple((int(e - n), int(e)) for e, n in zip(ends, self.lengths))

  @property
  def final_hw(self) -> int:
    return self.patch_nums[-1]

  @functools.lru_cache(maxsize=None)
  def level_ids(self) -> np.ndarray:
    """[L] int32: the scale index of every token."""
    return np.repeat(np.arange(self.num_scales, dtype=np.int32), self.lengths)

  def image_size(self, downsample: int) -> int:
    return self.final_hw * downsample

  def check_image_size(self, image_size: int, downsample: int) -> None:
    if image_size != self.image_size(downsample):
      raise ValueError(
          f'image size {image_size} does not match the schedule {self.patch_nums}: '
          f'its last scale {self.final_hw} x downsample {downsample} = '
          f'{self.image_size(downsample)}')


VAR_256 = ScaleSchedule((1, 2, 3, 4, 5, 6, 8, 10, 13, 16))
VAR_512 = ScaleSchedule((1, 2, 3, 4, 6, 9, 13, 18, 24, 32))
INFINITY_1024 = ScaleSchedule((1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64))

NAMED = {'var_256': VAR_256, 'var_512': VAR_512, 'infinity_1024': INFINITY_1024}


def get_schedule(name_or_patch_nums) -> ScaleSchedule:
  """A named schedule ('var_256', 'var_512', 'infinity_1024') or a tuple."""
  if isinstance(name_or_patch_nums, ScaleSchedule):
    return name_or_patch_nums
  if isinstance(name_or_patch_nums, str):
    if name_or_patch_nums not in NAMED:
      raise ValueError(f'unknown schedule {name_or_patch_nums!r}; known: {sorted(NAMED)}')
    return NAMED[name_or_patch_nums]
  return ScaleSchedule(tuple(name_or_patch_nums))
