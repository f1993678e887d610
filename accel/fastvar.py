"""FastVAR (Guo et al. 2025): Pivotal Token Selection + Cached Token Restoration, as the authors' code computes it.

    sample = make_sampler(var_cfg, vq_cfg, policy=accel.FastVAR.preset('infinity_2b'))

At a *pruned* scale (side h = w, L = h * w tokens, fraction `ratio` pruned), in each chosen block,
before self-attention and again before the FFN:
  - PTS: score_i = sum_c (x_ic - mean_j x_jc)^2 on the residual stream x [B, L, C] before the
    (ada)LN, the mean over the scale's L tokens of each batch row (the CFG halves select apart);
    the keep = L - int(L * ratio) highest scores are forwarded (ties: the lower token index
    wins, `lax.top_k`'s rule), in descending score order as the authors' sort gives them;
  - the sub-layer (norm, modulation, attention or FFN, gamma) runs on those tokens only, so only
    their keys and values enter the KV cache;
  - CTR: the sub-layer's full output at the *cache* scale (after gamma, before the residual add,
    stored per block, sub-layer and batch row) is resized to h x w with PyTorch's 'area'
    resampling, the computed rows are scattered into it, and the result is added to x. Pruned
    positions keep their own residual stream plus the stale resized output.
Blocks outside `blocks` run every token. A scale of ratio 1 (the paper's 100 %) is skipped: it
is not run at all (no forward, no sampling, no random draw) and the image decodes from f_hat as
it stands; only trailing scales may be skipped. A ratio of 0 runs the gather, the restoration
and the scatter keeping every token in order (the result equals the baseline bit for bit); leave
a scale out of `ratios` to run it plainly.

Kernels: the restoration's scatter goes through `pallas_kernels.token_scatter` (in place, 2-6x
XLA's scatter on these shapes, pallas_kernels/NOTES.md (c)); the gather stays
XLA's, which the same measurement found as fast or faster at batch 2 (one image with CFG).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
from jax import lax

from accel.presets import Presets, setting_error
import pallas_kernels as pk
from var_models.nn.blocks import BlockHooks
from var_models.nn.resample import area_resize, area_upsample
from var_models.nn.policy import Binding
from var_models.var.policy import ScalePolicy, Site, Step
from var_models.var.schedules import ScaleSchedule

Array = jax.Array

# name -> (settings, where they come from). Sides name the scales (patch_nums entries).
PRESETS = {
    'infinity_2b': (dict(ratios=((32, 0.4), (40, 0.5), (48, 1.0), (64, 1.0)), cache_at=24,
                         blocks=tuple(range(3, 28))),
                    "the authors' code for Infinity-2B at 1024 px (13 scales 1..64)"),
    'hart': (dict(ratios=((48, 0.5), (64, 0.75)), cache_at=40),
             "our mapping of the authors' HART-1024 setting (cache 36, 0.5 at 48, 0.75 at 64, every "
             "block, nothing skipped) onto the 13-scale schedule by the paper's rule: the cache is the "
             "scale just before the first pruned one, here 40"),
    'skip2': (dict(ratios=((48, 1.0), (64, 1.0))),
              'the last two scales of the 13-scale schedule skipped, nothing pruned: the skip-2 baseline '
              'SparVAR composes with (its appendix C)'),
    'var256': (dict(ratios=((13, 0.4), (16, 0.5)), cache_at=10),
               "ours for VAR at 256 px (10 scales 1..16): the paper's appendix A reports VAR results "
               "only (d30 2.2 s -> 1.9 s), no setting. Its small speed-up means nothing is skipped; "
               "the two finest scales (62 % of the tokens) are pruned at Infinity-2B's two ratios, "
               "the cache is the scale just before them, and every block prunes (block ranges do "
               "not carry over between depths)"),
}


def keep_count(num_tokens: int, ratio: float) -> int:
  """Tokens forwarded at a scale of num_tokens tokens pruned by `ratio`: L - int(L * ratio)."""
  return num_tokens - int(num_tokens * ratio)


def pts_scores(x: Array) -> Array:
  """PTS: each token's squared distance from its row's mean token, ||x_i - mean_j x_j||^2:
  x [B, L, C] -> [B, L] (float32, or x's dtype if wider)."""
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return jnp.sum(jnp.square(x - x.mean(1, keepdims=True)), -1)


def pivotal_tokens(x: Array, keep: int) -> Array:
  """PTS: indices [B, keep] of the keep tokens of x [B, L, C] farthest from their row's mean
  token, in descending score order as the authors' sort gives them; equal scores keep the
  lower index. keep = L selects nothing: every token, in order."""
  b, n, _ = x.shape
  if keep == n:
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  return lax.top_k(pts_scores(x), keep)[1]


def restore_tokens(cached: Array, side: int, y: Array, idx: Array) -> Array:
  """CTR: the cache-scale output cached [B, s * s, C] area-resized to side x side (in float32, like
  PyTorch's adaptive pooling of bf16; growing, by gathers), with the computed rows y [B, k, C]
  written at idx [B, k] -> [B, side * side, C] in y's dtype."""
  b, n, c = cached.shape
  s = int(round(n ** 0.5))
  grid = cached.reshape(b, s, s, c).astype(jnp.float32)
  base = (area_upsample if side >= s else area_resize)(grid, (side, side))
  return pk.token_scatter(base.reshape(b, side * side, c).astype(y.dtype), y, idx)


class FastVARHooks(BlockHooks):
  """One block at one step. keep None: forward everything and cache each sub-layer's output under
  `name`; else forward the `keep` pivotal tokens and restore the others from that cache at `side`."""

  def __init__(self, name: str, keep: Optional[int] = None, side: Optional[int] = None):
    self.name, self.keep, self.side = name, keep, side

  def select(self, site: str, x: Array, state: Any):
    return (None if self.keep is None else pivotal_tokens(x, self.keep)), state

  def selects(self, site: str) -> bool:
    return self.keep is not None

  def restore(self, site: str, y: Array, idx: Optional[Array], x: Array, state: Any):
    key = f'{self.name}/{site}'
    if self.keep is None:
      return y, {**state, key: y}
    return restore_tokens(state[key], self.side, y, idx), state

  def scan_group(self):
    return ('fastvar', self.keep, self.side)

  def layer_state(self) -> tuple[str, ...]:
    return (f'{self.name}/attn', f'{self.name}/ffn')


@dataclasses.dataclass(frozen=True)
class FastVAR(Presets, ScalePolicy):
  """Static settings (see the module docstring):
    ratios   -- ((side, fraction pruned), ...) per scale, named by its side; 1.0 skips the scale;
    cache_at -- side of the scale whose sub-layer outputs restore the pruned tokens;
    blocks   -- 0-based blocks that prune (None: every block); the others run every token;
    source   -- where the setting comes from (presets say).
  The sampler binds it to its schedule and depth (`bind`), which checks the settings against them.
  """
  PRESETS: ClassVar[dict] = PRESETS
  ratios: tuple[tuple[int, float], ...]
  cache_at: Optional[int] = None
  blocks: Optional[tuple[int, ...]] = None
  source: str = 'user'
  patch_nums: Optional[tuple[int, ...]] = dataclasses.field(default=None, repr=False)  # set by bind

  def __post_init__(self):
    ratios = tuple((int(s), float(r)) for s, r in self.ratios)
    sides = [s for s, _ in ratios]
    if len(set(sides)) != len(sides) or any(s <= 0 for s in sides):
      raise setting_error(self, 'ratios', f'scale sides must be distinct and positive, got {sides}')
    for side, r in ratios:
      if not 0.0 <= r <= 1.0:
        raise setting_error(self, 'ratios', f'the ratio of scale {side} must be in [0, 1], got {r}')
    object.__setattr__(self, 'ratios', tuple(sorted(ratios)))
    if self.pruned and self.cache_at is None:
      raise setting_error(self, 'cache_at', f'pruned scales {sorted(self.pruned)} need a cache scale')
    if self.blocks is not None:
      blocks = tuple(sorted(int(i) for i in self.blocks))
      if any(i < 0 for i in blocks) or len(set(blocks)) != len(blocks):
        raise setting_error(self, 'blocks', f'block indices must be distinct and >= 0, got {self.blocks}')
      object.__setattr__(self, 'blocks', blocks)

  @property
  def pruned(self) -> dict[int, float]:
    """side -> ratio of the scales that run pruned (ratio < 1)."""
    return {s: r for s, r in self.ratios if r < 1.0}

  @property
  def skipped(self) -> tuple[int, ...]:
    return tuple(s for s, r in self.ratios if r == 1.0)

  def bind(self, binding: Binding) -> 'FastVAR':
    pns, depth = binding.schedule.patch_nums, binding.model.depth
    for side, _ in self.ratios:
      if side not in pns:
        raise setting_error(self, 'ratios', f'scale {side} is not in the schedule {pns}')
    if self.cache_at is not None and self.cache_at not in pns:
      raise setting_error(self, 'cache_at', f'scale {self.cache_at} is not in the schedule {pns}')
    late = [s for s, _ in self.ratios if s <= (self.cache_at or 0)]
    if self.pruned and late:
      raise setting_error(self, 'cache_at', f'the cache scale {self.cache_at} must come before every pruned or '
                          f'skipped scale, but {late} do not follow it')
    if self.skipped and pns[-len(self.skipped):] != self.skipped:
      raise setting_error(self, 'ratios', f'only the last scales of {pns} may be skipped (ratio 1), got {self.skipped}')
    if len(self.skipped) >= len(pns):
      raise setting_error(self, 'ratios', 'every scale is skipped')
    if self.blocks and self.blocks[-1] >= depth:
      raise setting_error(self, 'blocks', f'block {self.blocks[-1]} is past the depth {depth} (0-based)')
    return dataclasses.replace(self, patch_nums=pns)

  def plan(self, sched: ScaleSchedule) -> tuple[Step, ...]:
    return tuple(Step((si,)) for si in range(sched.num_scales - len(self.skipped)))

  def init_state(self, batch: int) -> dict:
    """The cache-scale outputs {'BLOCK/SITE': [2B, cache_at ** 2, C]}, filled at the cache step."""
    return {}

  def block_hooks(self, site: Site, depth: int):
    if self.patch_nums is None:
      raise ValueError('FastVAR.block_hooks: bind the policy to a schedule first (make_sampler does)')
    side = self.patch_nums[site.step.scales[0]]
    if side in self.pruned:
      keep = keep_count(side * side, self.pruned[side])
    elif side == self.cache_at and self.pruned:
      keep = None
    else:
      return None
    chosen = range(depth) if self.blocks is None else self.blocks
    return [FastVARHooks(str(i), keep, side) if i in chosen else None for i in range(depth)]
