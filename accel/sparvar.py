"""SparVAR (2025): sparse attention at the last scales of a next-scale sampler (CS4A and CSLA).

    sample = make_sampler(var_cfg, vq_cfg, policy=accel.SparVAR.preset('infinity_2b'))

There is no public code; the paper (its section 3 and appendix A.2) is the source, with
Chipmunk's column-sum and tile packing for what it leaves implicit. Scales are named by their
side. Every scale up to the decision scale S runs dense attention in every block; at each
`sparse` scale K > S the first `cs4a_layers` of the blocks run CS4A, the others CSLA:

  - CS4A at S: dense attention P = softmax(q k^T); per query group of C = `group` consecutive
    queries the column sums of P over the group, and the top k of them, k = int(topk * N_<=S)
    keys among the N_<=S keys up to S (`pk.top_k_indices`: lax.top_k's set, in index order); the
    *selected* set is the sink (every token of the first `sink_scales` scales) united with them,
    deduplicated (a top-k key inside the sink becomes a padding entry: one static count, sink + k).
    The block caches its top-k indices and O_cache = O_dense - attention renormalised over the
    selected set, per block and head.
    (The paper's O_cache subtracts the top-k attention alone; with the sink in the set, as at
    every later scale, O_cache + the sparse term equals the dense output exactly at S.)
  - CS4A at K: query group g of K takes the indices of group round((g + 0.5) G_S / G_K - 0.5)
    of S, clipped (appendix A.2's homography; rounding half to even, NumPy's and torch's);
    each key j, of scale l at offset (u, v), moves to scale l' = l + (K - S) at
    (floor(u h_l' / h_l), floor(v w_l' / w_l)) (appendix A.2; its "max{i | C_i <= j}" is off by
    one as printed: the scale containing j and its start offset are meant); the sink is
    added as at S. O = O_cache upsampled from S's grid to K's (`cache_upsample`: bilinear by
    default, half-pixel centres; the paper does not say how) + attention over that set: one
    gathered-key kernel (`pallas_kernels.gathered_attention`).
  - CSLA at K: the static block layout `csla_layout` (sink scales, windows on
    the last scales, `point_windows` side-1 windows below them: 2 reproduces Table 4's block
    sparsities exactly), run by the block-sparse kernel.
The paper's setting without skipping (Infinity, 13 scales): S = its scale 11 (40x40),
the last two scales sparse, CS4A in 60 % of the layers from the shallowest (round(0.6 depth):
19 of Infinity-2B's 32, 24 of Infinity-8B's 40), CSLA in the rest. Its skip-2 setting
(S = scale 10, scale 11 sparse, the last two skipped) composes the preset `skip2` with FastVAR's
trailing skip: `policy_from_spec('fastvar:skip2+sparvar:skip2')`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels.layout import RowsFn
from accel.presets import Presets, setting_error
from var_models.nn import attention as attn_lib
from var_models.nn import resample
from var_models.nn.blocks import BlockHooks
from var_models.nn.policy import Binding
from var_models.var.policy import ScalePolicy, Site

Array = jax.Array
UPSAMPLING = {'linear': 'bilinear', 'nearest': 'nearest-exact'}   # jax.image.resize's names -> resample's

_INFINITY = dict(decision=40, sparse=(48, 64))
_VAR256 = dict(decision=10, sparse=(13, 16), group=64)
# name -> (settings, where they come from)
PRESETS = {
    'infinity_2b': (_INFINITY, "the paper without skipping (Infinity, 13 scales): decision scale 11 "
                               "(40x40), the last two scales sparse, CS4A : CSLA = 6 : 4 from the "
                               "shallowest layer, top-k 0.2, C = 192, sink scales <= 5, windows 3, 5, 7"),
    'infinity_8b': (_INFINITY, "the paper's setting for Infinity-8B: infinity_2b's (the paper uses one "
                               'for both)'),
    'infinity_2b_s10': ({**_INFINITY, 'decision': 32, 'sparse': (40, 48, 64)},
                        'decision scale 10 (32x32) without skipping, the trade-off its sections 3.2 and 4.3 '
                        'call best: the last three scales sparse'),
    'skip2': ({**_INFINITY, 'decision': 32, 'sparse': (40,)},
              "the paper's skip-2 setting (decision scale 10, scale 11 sparse) for the spec "
              "'fastvar:skip2+sparvar:skip2', FastVAR's trailing skip of the last two scales"),
    'infinity_2b_table4': ({**_INFINITY, 'point_windows': 2},
                           'infinity_2b with the CSLA layout that reproduces Table 4 (side-1 windows '
                           'on the two scales below the windowed three)'),
    'cs4a_only': ({**_INFINITY, 'cs4a_layers': 1.0}, "Table 5's CS4A row: every layer CS4A"),
    'cs4a_no_cache': ({**_INFINITY, 'cs4a_layers': 1.0, 'cache': False},
                      "Table 5's CS4A row without O_cache"),
    'csla_only': ({**_INFINITY, 'cs4a_layers': 0.0}, 'ablation: every layer CSLA'),
    'var256': (_VAR256, 'ours for VAR at 256 px (10 scales 1..16): the paper has no VAR setting; the '
                        'decision scale is the one before the sparse two, as in the paper, and C = 64 gives '
                        'it two query groups (C = 192 would give it one)'),
    'var256_cs4a_only': ({**_VAR256, 'cs4a_layers': 1.0}, 'var256 with every layer CS4A'),
    'var256_csla_only': ({**_VAR256, 'cs4a_layers': 0.0}, 'var256 with every layer CSLA'),
}


def key_map(patch_nums: tuple[int, ...], s: int, k: int) -> np.ndarray:
  """[N_<=s] int32: appendix A.2's position at scale index k of every key up to scale index s."""
  starts = np.concatenate([[0], np.cumsum([p * p for p in patch_nums])])
  out = []
  for l in range(s + 1):
    src, dst = patch_nums[l], patch_nums[l + k - s]
    u, v = np.divmod(np.arange(src * src), src)
    out.append(starts[l + k - s] + (u * dst) // src * dst + (v * dst) // src)
  return np.concatenate(out).astype(np.int32)


def group_map(groups_s: int, groups_k: int) -> np.ndarray:
  """[G_K] int32: the decision scale's query group of each of scale K's (appendix A.2)."""
  g = np.rint((np.arange(groups_k) + 0.5) / groups_k * groups_s - 0.5)
  return np.clip(g, 0, groups_s - 1).astype(np.int32)


def with_sink(top: Array, sink: int) -> Array:
  """The sink's keys [0, sink) united with top [B, H, G, k] (distinct keys) -> [B, H, G, sink + k]
  int32: the sink first, then top with its keys inside the sink turned into padding (-1). The
  kernel takes a list in any order, so nothing is sorted."""
  base = jnp.broadcast_to(jnp.arange(sink, dtype=jnp.int32), top.shape[:3] + (sink,))
  return jnp.concatenate([base, jnp.where(top < sink, -1, top).astype(jnp.int32)], -1)


def dense_with_column_sums(q: Array, k: Array, v: Array, kv_len: int, scale: float, group: int):
  """Dense attention and the column sums of its probabilities per query group.

  q [B, Lq, H, D], k and v [B, >= kv_len, H, D] -> (out [B, Lq, H, D] in q's dtype, sums
  [B, H, ceil(Lq / group), kv_len] float32). The flash forward (`pk.block_sparse_attention`
  on the dense layout) gives out and each row's log-sum-exp, then `pk.group_column_sums` the
  sums: neither materialises the [B, H, Lq, kv_len] probabilities. Buffer rows past kv_len,
  up to the last key block, must be finite (a KV cache's zeros are). Head dims that are not a
  power of two >= 16, other dtypes than float32 / bfloat16 / float16 and groups that are not
  multiples of 16 take the plain-jnp computation.
  """
  lq, d = q.shape[1], q.shape[-1]
  kv_len = k.shape[1] if kv_len is None else int(kv_len)
  if not (d < 16 or d & (d - 1) or group % 16
          or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16)):
    layout = pk.dense_layout(lq, kv_len, pk.default_block(lq), pk.default_block(kv_len))
    end = min(k.shape[1], layout.num_k_blocks * layout.block_k)   # the kernel's key blocks
    out, lse = pk.block_sparse_attention(q, k[:, :end], v[:, :end], layout, scale=scale,
                                         return_lse=True)
    return out, pk.group_column_sums(q, k, lse, group=group, scale=scale, kv_len=kv_len)
  return reference.dense_column_sums(q, k, v, kv_len, scale, group)


def add_upsampled(x: Array, cache: Array, src: int, dst: int, method: str) -> Array:
  """x [B, dst * dst, H, D] + cache [B, src * src, H, D] resampled onto x's grid by `method` (one of
  UPSAMPLING), summed in float32, in x's dtype: static taps (`resample.grid_taps`), one
  gather-and-add that XLA fuses (no float32 grid in memory)."""
  rows, weights = resample.grid_taps(src, dst, UPSAMPLING[method])
  acc = x.astype(jnp.float32)
  for t in range(rows.shape[1]):
    acc = acc + jnp.asarray(weights[:, t])[None, :, None, None] * cache[:, rows[:, t]].astype(jnp.float32)
  return acc.astype(x.dtype)


def check_whole_scale(q: Array, side: int) -> None:
  """SparVAR's query groups, key mapping and CSLA tiles are laid out on a whole scale."""
  if q.shape[1] != side * side:
    raise ValueError(f'SparVAR: the {side}x{side} scale\'s attention got {q.shape[1]} queries, not its '
                     f'{side * side} tokens: a policy composed with SparVAR forwards only some of them '
                     "(FastVAR's pivotal tokens, LazyVAR's kept tokens), and CS4A and CSLA need the whole "
                     "scale; compose SparVAR with trailing skips only ('fastvar:skip2+sparvar:skip2')")


class CS4AHooks(BlockHooks):
  """CS4A in one block, at the decision scale or at a sparse scale (`scale_idx`)."""

  def __init__(self, name: str, policy: 'SparVAR', scale_idx: int):
    self.name, self.p, self.k = name, policy, scale_idx

  def attend(self, q, k, v, *, mask, kv_len, scale, backend, state):
    check_whole_scale(q, self.p.patch_nums[self.k])
    run = functools.partial(self._gathered, q, k, v, kv_len=kv_len, scale=scale, backend=backend)
    s = self.p.patch_nums.index(self.p.decision)
    return self._decide(q, k, v, kv_len, scale, run, state) if self.k == s else self._sparse(s, run, state)

  def _gathered(self, q, k, v, top, *, kv_len, scale, backend):
    """Attention over the sink and the keys top [B, H, G, k] of each query group."""
    mask = attn_lib.GatheredKeys(with_sink(top, self.p.sink_len), self.p.group)
    return attn_lib.attention(q, k, v, mask=mask, scale=scale, kv_len=kv_len, backend=backend)

  def _decide(self, q, k, v, kv_len, scale, run, state):
    """Dense attention; caches the top keys of each group and O_cache = dense - sparse."""
    p = self.p
    out, sums = dense_with_column_sums(q, k, v, kv_len, scale, p.group)
    top = pk.top_k_indices(sums, p.top_count)
    state = {**state, f'{self.name}/top': top}
    if p.cache:
      residual = out.astype(jnp.float32) - run(top).astype(jnp.float32)
      state[f'{self.name}/cache'] = residual.astype(q.dtype)
    return out, state

  def _sparse(self, s, run, state):
    """The decision scale's keys mapped onto this scale, plus the upsampled O_cache."""
    p, top = self.p, state[f'{self.name}/top']
    groups_k = -(-p.patch_nums[self.k] ** 2 // p.group)
    out = run(jnp.asarray(key_map(p.patch_nums, s, self.k))[top[:, :, group_map(top.shape[2], groups_k)]])
    if p.cache:
      out = add_upsampled(out, state[f'{self.name}/cache'], p.decision, p.patch_nums[self.k],
                          p.cache_upsample)
    return out, state

  def scan_group(self):
    return ('cs4a', self.k, id(self.p))

  def layer_state(self) -> tuple[str, ...]:
    return (f'{self.name}/top', f'{self.name}/cache')


class CSLAHooks(BlockHooks):
  """CSLA in one block at one sparse scale: the static layout, through the block-sparse kernel."""

  def __init__(self, layout, side: int):
    self.mask, self.side = attn_lib.BlockSparse(layout), side

  def attend(self, q, k, v, *, mask, kv_len, scale, backend, state):
    check_whole_scale(q, self.side)
    return attn_lib.attention(q, k, v, mask=self.mask, scale=scale, kv_len=kv_len, backend=backend), state

  def scan_group(self):
    return ('csla', id(self))   # one object serves every CSLA block of a scale


def _csla_rows(patch_nums, query_scale, sink_scales, windows) -> RowsFn:
  """Token rows of SparVAR's CSLA mask for the queries of scale `query_scale`."""
  pns = tuple(patch_nums)
  offsets = np.concatenate([[0], np.cumsum([p * p for p in pns])])
  lk = int(offsets[query_scale + 1])
  side = pns[query_scale]
  first_window = query_scale + 1 - len(windows)

  def rows(q0, q1):
    qy, qx = np.divmod(np.arange(q0, q1), side)
    out = np.zeros((1, q1 - q0, lk), bool)
    out[0, :, :offsets[sink_scales]] = True
    for w, h in zip(windows, range(first_window, query_scale + 1)):
      ky, kx = np.divmod(np.arange(pns[h] * pns[h]), pns[h])
      # Query position mapped onto scale h's grid (the paper's round(x / H_k * H_h)).
      cy, cx = np.round(qy / side * pns[h]), np.round(qx / side * pns[h])
      near = ((np.abs(cy[:, None] - ky[None]) <= w // 2)
              & (np.abs(cx[:, None] - kx[None]) <= w // 2))
      out[0, :, offsets[h]:offsets[h + 1]] |= near
    return out
  return rows


def csla_layout(patch_nums: Sequence[int], *, sink_scales: int = 5,
                windows: Sequence[int] = (3, 5, 7), query_scale: int = -1,
                block_q: int = 128, block_k: int = 128, block_wise: bool = True,
                point_windows: int = 0) -> pk.BlockLayout:
  """SparVAR's cross-scale local sparse attention for the queries of one scale.

  Queries: the tokens of scale `query_scale` (default the last); keys: every
  token of scales 0..query_scale. Keys of the first `sink_scales` scales are seen
  by every query; the last len(windows) scales up to the query scale get square
  windows of those sides (windows[-1] on the query scale itself) around each
  query's position mapped onto their grid. `block_wise` (the paper's kernel)
  computes every tile the token mask touches densely; otherwise the token mask
  is kept inside partial tiles.

  `point_windows` more scales just below the windowed ones get windows of side
  1: each query also sees the one token at its mapped position there. The
  paper's text has none; 2 (windows 1, 1, 3, 5, 7 on the last five scales)
  reproduces all 11 block sparsities of SparVAR's Table 4 exactly, read as
  FlexAttention's BlockMask.sparsity() (pallas_kernels/NOTES.md, CSLA density note). The
  default 0 follows the text.
  """
  pns = tuple(int(p) for p in patch_nums)
  n = len(pns)
  qs = query_scale % n if -n <= query_scale < n else None
  if qs is None:
    raise ValueError(f'query_scale {query_scale} out of range for {n} scales')
  if not 0 <= sink_scales <= qs + 1:
    raise ValueError(f'sink_scales must be in [0, {qs + 1}], got {sink_scales}')
  if point_windows < 0:
    raise ValueError(f'point_windows must be >= 0, got {point_windows}')
  windows = (1,) * point_windows + tuple(windows)
  if len(windows) > qs + 1 or any(w < 1 for w in windows):
    raise ValueError(f'windows {tuple(windows)} must be positive sides for at most '
                     f'{qs + 1} scales')
  rows = _csla_rows(pns, qs, sink_scales, tuple(int(w) for w in windows))
  lq, lk = pns[qs] ** 2, sum(p * p for p in pns[:qs + 1])
  token = pk.layout_from_rows(rows, 1, lq, lk, block_q, block_k)
  return pk.whole_tile_layout(token) if block_wise else token


@functools.lru_cache(maxsize=32)
def _csla(patch_nums, query_scale, sink_scales, windows, point_windows, block):
  return csla_layout(patch_nums, sink_scales=sink_scales, windows=windows, query_scale=query_scale,
                     block_q=block, block_k=block, point_windows=point_windows)


@dataclasses.dataclass(frozen=True)
class SparVAR(Presets, ScalePolicy):
  """Static settings (see the module docstring):
    decision       -- side of the sparse decision scale S;
    sparse         -- sides of the sparse scales, all after S;
    topk           -- fraction of the keys up to S each CS4A query group keeps (0.2);
    group          -- C, queries per CS4A query group (192);
    sink_scales    -- the first scales, every token of which each sparse query sees (5);
    cs4a_layers    -- fraction of the blocks, from the first, that run CS4A; the rest CSLA (0.6);
    windows, point_windows, block -- CSLA's layout (`csla_layout`);
    cache          -- add CS4A's O_cache (Table 5's ablation turns it off);
    cache_upsample -- how O_cache reaches a larger scale: 'linear' (bilinear) or 'nearest';
    source         -- where the setting comes from (presets say).
  """
  PRESETS: ClassVar[dict] = PRESETS
  decision: int
  sparse: tuple[int, ...]
  topk: float = 0.2
  group: int = 192
  sink_scales: int = 5
  cs4a_layers: float = 0.6
  windows: tuple[int, ...] = (3, 5, 7)
  point_windows: int = 0
  block: int = 128
  cache: bool = True
  cache_upsample: str = 'linear'
  source: str = 'user'
  patch_nums: Optional[tuple[int, ...]] = dataclasses.field(default=None, repr=False)  # set by bind

  def __post_init__(self):
    object.__setattr__(self, 'sparse', tuple(sorted(int(s) for s in self.sparse)))
    object.__setattr__(self, 'windows', tuple(int(w) for w in self.windows))
    if not self.sparse or any(s <= self.decision for s in self.sparse):
      raise setting_error(self, 'sparse',
                          f'sides {self.sparse} must be non-empty and larger than decision={self.decision}')
    if not 0.0 < self.topk <= 1.0:
      raise setting_error(self, 'topk', f'must be in (0, 1], got {self.topk}')
    if not 0.0 <= self.cs4a_layers <= 1.0:
      raise setting_error(self, 'cs4a_layers', f'must be in [0, 1], got {self.cs4a_layers}')
    if self.group < 16 or self.group % 16:
      raise setting_error(self, 'group',
                          f'must be a positive multiple of 16 (the kernel query block), got {self.group}')
    if self.cache_upsample not in UPSAMPLING:
      raise setting_error(self, 'cache_upsample', f'must be one of {tuple(UPSAMPLING)}, got {self.cache_upsample!r}')
    if self.sink_scales < 0:
      raise setting_error(self, 'sink_scales', f'must be >= 0, got {self.sink_scales}')

  def bind(self, binding: Binding) -> 'SparVAR':
    pns = binding.schedule.patch_nums
    for field, sides in (('decision', (self.decision,)), ('sparse', self.sparse)):
      missing = [s for s in sides if s not in pns]
      if missing:
        raise setting_error(self, field, f'scales {missing} are not in the schedule {pns}')
    s = pns.index(self.decision)
    if self.sink_scales > s + 1:
      raise setting_error(self, 'sink_scales', f'{self.sink_scales} sink scales reach past the decision scale '
                          f'{self.decision} (index {s})')
    bound = dataclasses.replace(self, patch_nums=pns)
    for side in self.sparse:   # the layouts' own checks, before anything compiles
      _csla(pns, pns.index(side), self.sink_scales, self.windows, self.point_windows, self.block)
    return bound

  @property
  def sink_len(self) -> int:
    return sum(p * p for p in self.patch_nums[:self.sink_scales])

  @property
  def top_count(self) -> int:
    """k: keys each CS4A query group keeps at the decision scale."""
    s = self.patch_nums.index(self.decision)
    return max(1, int(self.topk * sum(p * p for p in self.patch_nums[:s + 1])))

  def cs4a_count(self, depth: int) -> int:
    return int(round(self.cs4a_layers * depth))

  def init_state(self, batch: int) -> dict:
    """Per CS4A block, from the decision scale on: 'BLOCK/top' [2B, H, G_S, k] int32 (ascending)
    and 'BLOCK/cache' [2B, N_S, H, D] (O_cache)."""
    return {}

  def block_hooks(self, site: Site, depth: int):
    if self.patch_nums is None:
      raise ValueError('SparVAR.block_hooks: bind the policy to a schedule first (make_sampler does)')
    step = site.step
    if len(step.scales) != 1:
      raise ValueError(f'SparVAR: step {step} runs scales {step.scales} as one (parallel decoding, '
                       "LazyVAR's group): SparVAR needs one scale per step")
    (si,) = step.scales
    side, n_cs4a = self.patch_nums[si], self.cs4a_count(depth)
    if side == self.decision:
      return [CS4AHooks(str(i), self, si) if i < n_cs4a else None for i in range(depth)]
    if side not in self.sparse:
      return None
    csla = CSLAHooks(_csla(self.patch_nums, si, self.sink_scales, self.windows, self.point_windows,
                           self.block), side)
    return [CS4AHooks(str(i), self, si) if i < n_cs4a else csla for i in range(depth)]
