"""Block-sparse layout builders: the token mask each layout computes, its lists, its density."""
import numpy as np
import pytest

from pallas_kernels import (dense_layout, layout_density, layout_from_mask, scale_causal_layout,
                            schedule_levels, whole_tile_layout)
from pallas_kernels.layout import EMPTY, FULL, PARTIAL


def _check_lists(layout):
  """The forward and transposed lists describe the same tiles, full ones first."""
  kinds = layout.kinds()
  for h in range(layout.heads):
    for j in range(layout.num_k_blocks):
      ids = layout.q_ids[h, j, :layout.q_count[h, j]]
      np.testing.assert_array_equal(np.sort(ids), np.flatnonzero(kinds[h, :, j] != EMPTY))
      assert (kinds[h, ids[:layout.q_full[h, j]], j] == FULL).all()
      assert (kinds[h, ids[layout.q_full[h, j]:], j] == PARTIAL).all()


def test_scale_causal_layout_computes_the_level_mask_with_tails():
  patch_nums = (1, 2, 3, 4, 6)     # L = 66: not a multiple of 16
  layout = scale_causal_layout(patch_nums, 16, 16)
  levels = schedule_levels(patch_nums)
  np.testing.assert_array_equal(layout.dense()[0], levels[:, None] >= levels[None])
  kinds = layout.kinds()[0]
  assert kinds[4, 0] == FULL       # scale-4 queries see scales 0..3 whole
  assert (kinds[:, -1] != FULL).all()  # the key tail tile (66 = 4 * 16 + 2) is never full
  _check_lists(layout)


def test_mask_layout_round_trips_per_head_and_dedupes_partial_tiles():
  rng = np.random.default_rng(0)
  mask = rng.random((3, 40, 50)) < 0.3
  mask[:, :, :8] = np.tril(np.ones((40, 8), bool), -4)  # same partial pattern in many tiles
  mask[1, 16:32] = False
  layout = layout_from_mask(mask, 16, 8)
  np.testing.assert_array_equal(layout.dense(), mask)
  assert layout.heads == 3 and layout.kv_count[1, 1] == 0
  partial = layout.kinds() == PARTIAL
  assert len(layout.masks) < partial.sum()
  _check_lists(layout)


def test_whole_tile_layout_computes_whole_every_tile_the_layout_touches():
  rng = np.random.default_rng(1)
  mask = rng.random((2, 40, 50)) < 0.05         # 40 = 2 * 16 + 8, 50 = 6 * 8 + 2: tails on both axes
  token = layout_from_mask(mask, 16, 8)
  whole = whole_tile_layout(token)
  np.testing.assert_array_equal(whole.kinds() != EMPTY, token.kinds() != EMPTY)
  tiles = np.repeat(np.repeat(token.kinds() != EMPTY, 16, 1), 8, 2)[:, :40, :50]
  np.testing.assert_array_equal(whole.dense(), tiles)
  # Partial only where a tile reaches past Lq (the last query block) or Lk (the last key block).
  assert not (whole.kinds() == PARTIAL)[:, :-1, :-1].any()
  _check_lists(whole)


def test_density_of_dense_empty_and_scale_causal_layouts():
  assert layout_density(dense_layout(100, 70, 32, 32)) == 1.0
  assert layout_density(layout_from_mask(np.zeros((30, 20), bool), 16, 16)) == 0.0
  assert layout_density(scale_causal_layout((4,), 16, 16)) == 1.0  # one bidirectional scale
  # A token-causal 64 x 64 mask in 16-token tiles: the lower block triangle, 10 of 16.
  assert layout_density(layout_from_mask(np.tril(np.ones((64, 64), bool)), 16, 16)) == 10 / 16


@pytest.mark.parametrize('call, match', [
    (lambda: dense_layout(10, 10, 12, 16), 'block_q'),
    (lambda: layout_from_mask(np.ones(5, bool)), 'mask must be'),
    (lambda: scale_causal_layout((1, 0, 2)), 'patch_nums'),
])
def test_bad_layout_arguments_raise_clear_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()
