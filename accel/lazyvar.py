"""LazyVAR (CVPR 2026): update-index token pruning and parallel group decoding of the last scales.

    sample = make_sampler(var_cfg, vq_cfg, policy=accel.LazyVAR.preset('infinity_2b'))

There is no public code; the source is a third-party summary of the paper, and where it is
ambiguous the reading below is ours (each says so). Scales are 0-based here; the paper counts
from 1 (its scale 10 is our 9).

  - Update index: per position of f_hat's grid [B, H, W], u = 1 - cos over channels between
    f_hat before and after the scale that precedes the pruned scale (`update_index`), area-
    downsampled to the grid of the scale it prunes. Inside a group every scale uses the one
    index computed just before the group.
  - Pruning: a pruned scale forwards only the kept tokens (no query, no K/V in any layer, no
    logits); they keep their own position and level embeddings. A pruned position's residual
    is zero in the sampler's sense: its code embedding is zero before the upsample and Phi
    (so, as for any scale, Phi's bias and the bicubic spread of kept neighbours still reach it;
    zeroing the upsampled residual instead would cut kept tokens' own spread at the border).
  - Kept count of a scale of L tokens at retention r: n = max(1, round(r * L)) (20 % of 32x32
    = 204.8 -> 205), or 0 for r = 0.
  - Parallel group decoding: the group's scales are one step of the sampler, each scale's
    input being f_hat from before the group downsampled to its grid, under the block-causal
    scale mask of training (query of scale i sees keys of scales <= i).
  - Cumulative retention ('area', our reading of the garbled formula): scale m of the group
    keeps the ranks [cum_m, cum_m + n_m) of its own descending sort of the index, with
        cum_m = round(h_m w_m * sum_{j > m in the group} r_j) = round(sum_j (r_j h_j w_j) (h_m w_m) / (h_j w_j)),
    the larger scales' kept counts (unrounded) in this scale's area, so they take the
    highest-index positions and the smaller scales the next ones (Infinity, scales 13 -> 10:
    0 / 23 / 96 / 164). 'literal' measures those counts in the final grid's area, the
    summary's formula as printed, (h_K w_K) / (h_j w_j) (0 / 41 / 246 / 655); 'none' is cum = 0
    (the "w/o Cum" ablation). cum_m + n_m is clamped to the scale's L.
  - Without parallel decoding (`pgd=False`) every pruned scale is a step of its own, pruned
    by the index of the scale before it, with cum = 0.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np

from accel.presets import Presets, setting_error
from var_models.nn.resample import area_resize
from var_models.nn.policy import Binding
from var_models.var.policy import ScalePolicy, Site, Step
from var_models.var.schedules import ScaleSchedule

Array = jax.Array
CUM_READINGS = ('area', 'literal', 'none')

# name -> (settings, where they come from). `start` is the first pruned scale (0-based); ratios
# are the retention of every scale from `start` to the last.
PRESETS = {
    'infinity_2b': (dict(start=9, retention=(0.2, 0.1, 0.05, 0.01)),
                    'the paper: Infinity-2B, scales 1-9 full, group 10-13 at [20 %, 10 %, 5 %, 1 %]'),
    'no_pgd': (dict(start=9, retention=(0.2, 0.1, 0.05, 0.01), pgd=False),
               "the paper's 'w/o PGD' ablation: scales 10-13 one at a time"),
    'no_cum': (dict(start=9, retention=(0.2, 0.1, 0.05, 0.01), cum='none'),
               "the paper's 'w/o Cum' ablation"),
    'group5': (dict(start=8, retention=(0.4, 0.2, 0.1, 0.05, 0.01)),
               "the paper's group [9..13]; the summary gives no ratio for scale 9: ours, 40 %, "
               'twice the next scale as the default halves from scale to scale'),
    'keep40_20': (dict(start=9, retention=(0.4, 0.2, 0.05, 0.01)),
                  "the paper's [40 %, 20 %] ablation, read as the retention of the group's first two "
                  'scales (10, 11), the last two as the default'),
    'keep0_0': (dict(start=9, retention=(0.0, 0.0, 0.05, 0.01)),
                "the paper's [0 %, 0 %] ablation under the same reading: scales 10 and 11 forward nothing"),
    'var256': (dict(start=8, retention=(0.4, 0.2)),
               'ours for VAR at 256 px (10 scales 1..16): the last two scales (62 % of the tokens) '
               'as one group, at the [40 %, 20 %] retention the paper found no worse than its '
               'default: a 10-scale model has less redundancy per scale than Infinity'),
}


def update_index(f_prev: Array, f_now: Array) -> Array:
  """1 - cos over channels of f_hat [B, H, W, C] before and after a scale -> [B, H, W] in [0, 2]."""
  f_prev, f_now = f_prev.astype(jnp.float32), f_now.astype(jnp.float32)
  dot = jnp.sum(f_prev * f_now, axis=-1)
  norms = jnp.linalg.norm(f_prev, axis=-1) * jnp.linalg.norm(f_now, axis=-1)
  return 1.0 - dot / jnp.maximum(norms, 1e-12)


def kept_count(num_tokens: int, retention: float) -> int:
  return 0 if retention == 0 else max(1, int(np.floor(retention * num_tokens + 0.5)))


def cumulative_offsets(sides: tuple[int, ...], retention: tuple[float, ...], final_side: int,
                       reading: str) -> tuple[int, ...]:
  """Rank offset cum_m of every scale m of a group (sides ascending): the larger scales' kept
  fractions sum_{j > m} r_j measured in this scale's area ('area') or the final grid's
  ('literal'), rounded, clamped so the scale's own kept tokens fit; 0 for 'none'."""
  out = []
  for m, side in enumerate(sides):
    unit = {'area': side * side, 'literal': final_side * final_side, 'none': 0}[reading]
    cum = int(np.floor(unit * sum(retention[m + 1:]) + 0.5))
    out.append(min(cum, side * side - kept_count(side * side, retention[m])))
  return tuple(out)


def retained(index: Array, side: int, count: int, offset: int) -> Array:
  """The positions [B, count] (ascending) of ranks [offset, offset + count) of the descending
  sort of the update index [B, H, W] area-downsampled to side x side; ties: lower position first."""
  b = index.shape[0]
  u = area_resize(index[..., None], (side, side)).reshape(b, side * side)
  order = jnp.argsort(-u, axis=-1, stable=True)
  return jnp.sort(order[:, offset:offset + count], axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class LazyVAR(Presets, ScalePolicy):
  """Static settings (see the module docstring):
    start     -- the first pruned scale (0-based); every scale from it to the last is pruned;
    retention -- the kept fraction of each of those scales, in [0, 1] (0: forward nothing);
    pgd       -- decode them as one group (else one step each);
    cum       -- the cumulative retention reading, one of CUM_READINGS;
    source    -- where the setting comes from (presets say).
  """
  PRESETS: ClassVar[dict] = PRESETS
  start: int
  retention: tuple[float, ...]
  pgd: bool = True
  cum: str = 'area'
  source: str = 'user'
  sides: Optional[tuple[int, ...]] = dataclasses.field(default=None, repr=False)  # set by bind
  final_side: int = dataclasses.field(default=0, repr=False)

  def __post_init__(self):
    retention = tuple(float(r) for r in self.retention)
    if not retention or any(not 0.0 <= r <= 1.0 for r in retention):
      raise setting_error(self, 'retention', f'every retention must be in [0, 1], got {self.retention}')
    object.__setattr__(self, 'retention', retention)
    if self.start < 1:
      raise setting_error(self, 'start', f'scale 0 (the class token) cannot be pruned, got start={self.start}')
    if self.cum not in CUM_READINGS:
      raise setting_error(self, 'cum', f'must be one of {CUM_READINGS}, got {self.cum!r}')

  def bind(self, binding: Binding) -> 'LazyVAR':
    sched = binding.schedule
    if self.start + len(self.retention) != sched.num_scales:
      raise setting_error(self, 'retention', f'{len(self.retention)} scales from start={self.start} must reach the '
                          f'last of the {sched.num_scales} scales {sched.patch_nums}')
    return dataclasses.replace(self, sides=tuple(sched.patch_nums), final_side=sched.final_hw)

  @property
  def _pruned(self) -> tuple[int, ...]:
    return tuple(range(self.start, self.start + len(self.retention)))

  def _counts(self, scales) -> tuple[int, ...]:
    return tuple(kept_count(self.sides[si] ** 2, self.retention[si - self.start]) for si in scales)

  def plan(self, sched: ScaleSchedule) -> tuple[Step, ...]:
    full = tuple(Step((si,)) for si in range(self.start))
    return full + ((Step(self._pruned),) if self.pgd else tuple(Step((si,)) for si in self._pruned))

  def input_counts(self, step: Step) -> Optional[tuple[int, ...]]:
    return self._counts(step.scales) if step.scales[0] >= self.start else None

  def init_state(self, batch: int) -> dict:
    """Empty: `after_step` fills it with f_hat [B, H, W, C] before and after the last step."""
    return {}

  def after_step(self, site: Site, f_hat: Array, state: dict) -> dict:
    """Keeps f_hat [B, H, W, C] from before and after the last step (the scale loop is unrolled,
    so the state may change shape between steps)."""
    return {'f_prev': state.get('f_now', jnp.zeros_like(f_hat)), 'f_now': f_hat}

  def select_input(self, site: Site, x: Array, state: dict):
    """Kept positions [2B, k] over the step's concatenated tokens x [2B, l, C], scale by scale,
    ascending (both CFG halves keep the same ones)."""
    step = site.step
    counts = self.input_counts(step)
    if counts is None:
      return None, state
    index = update_index(state['f_prev'], state['f_now'])
    sides = tuple(self.sides[si] for si in step.scales)
    reading = self.cum if len(step.scales) > 1 else 'none'
    offsets = cumulative_offsets(sides, tuple(self.retention[si - self.start] for si in step.scales),
                                 self.final_side, reading)
    parts, base = [], 0
    for side, count, offset in zip(sides, counts, offsets):
      parts.append(retained(index, side, count, offset) + base)
      base += side * side
    sel = jnp.concatenate(parts, axis=1)
    return jnp.concatenate([sel, sel]), state
