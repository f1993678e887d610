"""Block-sparse attention layouts: which key blocks each query block visits.

A layout cuts the [Lq, Lk] attention matrix into [block_q, block_k] tiles and
stores, per query block, the list of its active key blocks -- full ones first,
then partial ones, each partial one naming a row of a shared token-mask table --
and the transposed lists (per key block, its active query blocks) for the
backward pass. Skipped tiles appear in no list, so they cost neither memory
traffic nor arithmetic. Lists are per head ([H, ...]) or shared ([1, ...]).

Tokens past Lq or Lk exist in no tile's mask: the key-tail tile is partial
whenever Lk is not a multiple of block_k.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import numpy as np

EMPTY, FULL, PARTIAL = 0, 1, 2

RowsFn = Callable[[int, int], np.ndarray]  # (q0, q1) -> [Hl, q1 - q0, Lk] bool


@dataclasses.dataclass(frozen=True, eq=False)
class BlockLayout:
  """Compact block-sparse layout (static NumPy; Hl = 1 shared or H per head).

  kv_ids [Hl, nQ, A]: active key blocks of each query block, full ones first;
  kv_full, kv_count [Hl, nQ]: how many are full, how many in all;
  kv_mask [Hl, nQ, A]: mask-table row of each partial entry (0 elsewhere);
  q_ids, q_full, q_count, q_mask: the same per key block over query blocks;
  masks [P, block_q, block_k] int8: token masks of the partial tiles (P >= 1).
  """
  lq: int
  lk: int
  block_q: int
  block_k: int
  kv_ids: np.ndarray
  kv_full: np.ndarray
  kv_count: np.ndarray
  kv_mask: np.ndarray
  q_ids: np.ndarray
  q_full: np.ndarray
  q_count: np.ndarray
  q_mask: np.ndarray
  masks: np.ndarray

  @property
  def heads(self) -> int:
    """1 for a layout shared by all heads, else the number of heads."""
    return self.kv_ids.shape[0]

  @property
  def num_q_blocks(self) -> int:
    return self.kv_ids.shape[1]

  @property
  def num_k_blocks(self) -> int:
    return self.q_ids.shape[1]

  def kinds(self) -> np.ndarray:
    """[Hl, nQ, nK] int8 tile kinds: EMPTY, FULL or PARTIAL."""
    out = np.zeros((self.heads, self.num_q_blocks, self.num_k_blocks), np.int8)
    for h in range(self.heads):
      for u in range(self.num_q_blocks):
        ids = self.kv_ids[h, u, :self.kv_count[h, u]]
        full = self.kv_full[h, u]
        out[h, u, ids[:full]] = FULL
        out[h, u, ids[full:]] = PARTIAL
    return out

  def dense(self) -> np.ndarray:
    """[Hl, Lq, Lk] bool token mask that the layout computes."""
    bq, bk = self.block_q, self.block_k
    nq, nk = self.num_q_blocks, self.num_k_blocks
    out = np.zeros((self.heads, nq * bq, nk * bk), bool)
    for h in range(self.heads):
      for u in range(nq):
        for t in range(self.kv_count[h, u]):
          j = self.kv_ids[h, u, t]
          tile = (True if t < self.kv_full[h, u]
                  else self.masks[self.kv_mask[h, u, t]].astype(bool))
          out[h, u * bq:(u + 1) * bq, j * bk:(j + 1) * bk] = tile
    return out[:, :self.lq, :self.lk]


def _check_blocks(lq: int, lk: int, block_q: int, block_k: int) -> None:
  if lq <= 0 or lk <= 0:
    raise ValueError(f'layout lengths must be positive, got lq={lq}, lk={lk}')
  for name, b in (('block_q', block_q), ('block_k', block_k)):
    if b < 1 or b & (b - 1):
      raise ValueError(f'{name} must be a power of two, got {b}')


def _lists(kinds: np.ndarray, mask_ids: np.ndarray):
  """Per row of kinds [Hl, R, C]: (ids, n_full, count, mask_ids), full first."""
  hl, r, _ = kinds.shape
  width = max(1, int((kinds != EMPTY).sum(-1).max()))
  ids = np.zeros((hl, r, width), np.int32)
  mids = np.zeros((hl, r, width), np.int32)
  n_full = np.zeros((hl, r), np.int32)
  count = np.zeros((hl, r), np.int32)
  for h in range(hl):
    for u in range(r):
      full = np.flatnonzero(kinds[h, u] == FULL)
      part = np.flatnonzero(kinds[h, u] == PARTIAL)
      row = np.concatenate([full, part])
      ids[h, u, :len(row)] = row
      mids[h, u, len(full):len(row)] = mask_ids[h, u, part]
      n_full[h, u], count[h, u] = len(full), len(row)
  return ids, n_full, count, mids


def _from_kinds(kinds, mask_ids, masks, lq, lk, block_q, block_k) -> BlockLayout:
  kv = _lists(kinds, mask_ids)
  qs = _lists(kinds.transpose(0, 2, 1), mask_ids.transpose(0, 2, 1))
  if not masks:
    masks = [np.zeros((block_q, block_k), np.int8)]
  return BlockLayout(lq, lk, block_q, block_k, *kv, *qs, np.stack(masks))


def layout_from_rows(rows: RowsFn, heads: int, lq: int, lk: int,
                     block_q: int, block_k: int) -> BlockLayout:
  """Layout of the token mask that `rows(q0, q1) -> [heads, q1 - q0, Lk]` yields,
  one query block at a time (the dense [Lq, Lk] mask never exists whole)."""
  _check_blocks(lq, lk, block_q, block_k)
  nq, nk = -(-lq // block_q), -(-lk // block_k)
  kinds = np.zeros((heads, nq, nk), np.int8)
  mask_ids = np.zeros((heads, nq, nk), np.int32)
  table, seen = [], {}
  for u in range(nq):
    q0, q1 = u * block_q, min(lq, (u + 1) * block_q)
    m = np.asarray(rows(q0, q1), bool)
    if m.shape != (heads, q1 - q0, lk):
      raise ValueError(f'mask rows {q0}:{q1} have shape {m.shape}, want {(heads, q1 - q0, lk)}')
    tiles = np.zeros((heads, block_q, nk * block_k), bool)
    tiles[:, :q1 - q0, :lk] = m
    tiles = tiles.reshape(heads, block_q, nk, block_k).transpose(0, 2, 1, 3)
    active = tiles.any((2, 3))
    full = tiles[:, :, :q1 - q0].all((2, 3))
    kinds[:, u] = np.where(full, FULL, np.where(active, PARTIAL, EMPTY))
    for h, j in zip(*np.nonzero(active & ~full)):
      tile = tiles[h, j].astype(np.int8)
      key = tile.tobytes()
      if key not in seen:
        seen[key] = len(table)
        table.append(tile)
      mask_ids[h, u, j] = seen[key]
  return _from_kinds(kinds, mask_ids, table, lq, lk, block_q, block_k)


def layout_from_mask(mask: np.ndarray, block_q: int = 128, block_k: int = 128) -> BlockLayout:
  """Layout of a token mask [Lq, Lk] (shared) or [H, Lq, Lk] (per head), True = attend."""
  mask = np.asarray(mask, bool)
  if mask.ndim == 2:
    mask = mask[None]
  if mask.ndim != 3:
    raise ValueError(f'mask must be [Lq, Lk] or [H, Lq, Lk], got shape {mask.shape}')
  return layout_from_rows(lambda q0, q1: mask[:, q0:q1], mask.shape[0], mask.shape[1],
                          mask.shape[2], block_q, block_k)


def default_block(n: int) -> int:
  """Tile side for a sequence of n tokens: 128, or the next power of two (>= 16) below."""
  return max(16, min(128, 1 << max(0, n - 1).bit_length()))


@functools.lru_cache(maxsize=64)
def dense_layout(lq: int, lk: int, block_q: int = 128, block_k: int = 128,
                 kv_len: Optional[int] = None) -> BlockLayout:
  """Every query sees every key (the first kv_len keys only, when given)."""
  kv_len = lk if kv_len is None else kv_len
  if not 0 < kv_len <= lk:
    raise ValueError(f'kv_len must be in (0, {lk}], got {kv_len}')
  return layout_from_rows(lambda q0, q1: np.broadcast_to(np.arange(lk) < kv_len, (1, q1 - q0, lk)),
                          1, lq, lk, block_q, block_k)


@functools.lru_cache(maxsize=64)
def _level_causal(q_bytes: bytes, k_bytes: bytes, block_q: int, block_k: int) -> BlockLayout:
  ql, kl = np.frombuffer(q_bytes, np.int64), np.frombuffer(k_bytes, np.int64)
  return layout_from_rows(lambda q0, q1: (ql[q0:q1, None] >= kl[None, :])[None], 1,
                          len(ql), len(kl), block_q, block_k)


def level_causal_layout(q_levels: np.ndarray, k_levels: np.ndarray, block_q: int = 128,
                        block_k: int = 128) -> BlockLayout:
  """Query i sees key j iff q_levels[i] >= k_levels[j] (causal across scales).

  Cached by content: every block of a model asks for the same layout.
  """
  ql, kl = np.asarray(q_levels), np.asarray(k_levels)
  if ql.ndim != 1 or kl.ndim != 1:
    raise ValueError(f'levels must be 1-D, got {ql.shape} and {kl.shape}')
  return _level_causal(ql.astype(np.int64).tobytes(), kl.astype(np.int64).tobytes(),
                       block_q, block_k)


def schedule_levels(patch_nums: Sequence[int]) -> np.ndarray:
  """[L] int32 scale index of each token of square scales `patch_nums`."""
  pns = tuple(int(p) for p in patch_nums)
  if not pns or any(p <= 0 for p in pns):
    raise ValueError(f'patch_nums must be positive ints, got {patch_nums}')
  return np.repeat(np.arange(len(pns), dtype=np.int32), [p * p for p in pns])


def scale_causal_layout(patch_nums: Sequence[int], block_q: int = 128,
                        block_k: int = 128) -> BlockLayout:
  """Training layout of a scale schedule: causal across scales, bidirectional inside one."""
  levels = schedule_levels(patch_nums)
  return level_causal_layout(levels, levels, block_q, block_k)


def whole_tile_layout(layout: BlockLayout) -> BlockLayout:
  """The layout computing whole every tile `layout` touches (a block-wise mask: FlexAttention's
  BlockMask, a block-sparse kernel without token masks). Same tiles; partial ones are left only
  where a tile reaches past Lq or Lk."""
  active = layout.kinds() != EMPTY   # [Hl, nQ, nK]
  bq, bk = layout.block_q, layout.block_k
  return layout_from_rows(
      lambda q0, q1: np.repeat(np.repeat(active[:, q0 // bq:q0 // bq + 1], q1 - q0, 1), bk, 2)[:, :, :layout.lk],
      layout.heads, layout.lq, layout.lk, bq, bk)


def layout_density(layout: BlockLayout) -> float:
  """Fraction of the [block_q, block_k] tiles that the layout computes (mean over heads)."""
  return float(layout.kv_count.sum() / (layout.heads * layout.num_q_blocks * layout.num_k_blocks))
