"""Block-sparse layout builders: the token mask each layout computes, its lists, its density."""
import numpy as np
import pytest

from pallas_kernels import (csla_layout, dense_layout, layout_density, layout_from_mask,
                            scale_causal_layout, schedule_levels)
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


def _csla_token_mask(patch_nums, sink_scales, windows):
  """Per-token loop of SparVAR's CSLA mask for the last scale's queries."""
  offsets = np.concatenate([[0], np.cumsum([p * p for p in patch_nums])])
  side = patch_nums[-1]
  first = len(patch_nums) - len(windows)
  out = np.zeros((side * side, offsets[-1]), bool)
  for i in range(side * side):
    out[i, :offsets[sink_scales]] = True
    for w, h in zip(windows, range(first, len(patch_nums))):
      pn = patch_nums[h]
      cy, cx = round(i // side / side * pn), round(i % side / side * pn)
      for j in range(pn * pn):
        if abs(j // pn - cy) <= w // 2 and abs(j % pn - cx) <= w // 2:
          out[i, offsets[h] + j] = True
  return out


def test_csla_token_layout_matches_per_token_definition():
  patch_nums = (1, 2, 4, 6, 8)
  layout = csla_layout(patch_nums, sink_scales=2, windows=(1, 3, 5), block_q=16, block_k=16,
                       block_wise=False)
  want = _csla_token_mask(patch_nums, 2, (1, 3, 5))
  assert (layout.lq, layout.lk) == want.shape == (64, 121)
  np.testing.assert_array_equal(layout.dense()[0], want)


def test_csla_block_wise_layout_computes_whole_tiles_covering_the_token_mask():
  patch_nums = (1, 2, 4, 6, 8)
  token = csla_layout(patch_nums, sink_scales=2, windows=(1, 3, 5), block_q=16, block_k=16,
                      block_wise=False)
  blocks = csla_layout(patch_nums, sink_scales=2, windows=(1, 3, 5), block_q=16, block_k=16)
  assert (blocks.dense() >= token.dense()).all()
  np.testing.assert_array_equal(blocks.kinds() != EMPTY, token.kinds() != EMPTY)
  # Only the key tail (121 = 7 * 16 + 9) is partial in the block-wise layout.
  partial_cols = np.flatnonzero((blocks.kinds() == PARTIAL).any((0, 1)))
  np.testing.assert_array_equal(partial_cols, [7])
  assert 0 < layout_density(blocks) < 1


INFINITY_1024 = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)


def _flex_sparsity(layout):
  """SparVAR's figure: FlexAttention's BlockMask.sparsity(), whole tiles over Lq * Lk tokens."""
  tiles = layout.kv_count.sum() * layout.block_q * layout.block_k
  return 100 * (1 - tiles / (layout.lq * layout.lk))


def test_csla_block_sparsity_at_the_papers_last_scale():
  text = csla_layout(INFINITY_1024)
  fit = csla_layout(INFINITY_1024, point_windows=2)
  assert (text.lq, text.lk, text.num_q_blocks, text.num_k_blocks) == (4096, 10521, 32, 83)
  assert (text.kv_count.sum(), fit.kv_count.sum()) == (355, 435)
  assert layout_density(text) == 355 / 2656 and layout_density(fit) == 435 / 2656
  assert (round(_flex_sparsity(text), 2), round(_flex_sparsity(fit), 2)) == (86.50, 83.46)
  assert (fit.dense() >= text.dense()).all()


@pytest.mark.parametrize('sink_scales, windows, table4', [
    (5, (1, 3, 5), 86.24), (5, (3, 3, 3), 86.77), (5, (3, 5, 7), 83.46), (5, (5, 5, 5), 83.77),
    (5, (5, 7, 9), 80.72), (5, (7, 7, 7), 81.18), (5, (7, 9, 11), 78.06), (6, (3, 5, 7), 81.03),
    (7, (3, 5, 7), 78.60), (8, (3, 5, 7), 75.21), (0, (3, 5, 7), 84.68)])
def test_csla_point_windows_reproduce_sparvar_table4(sink_scales, windows, table4):
  # The token layout has the block-wise one's tiles (test above) and builds faster.
  layout = csla_layout(INFINITY_1024, sink_scales=sink_scales, windows=windows,
                       point_windows=2, block_wise=False)
  assert round(_flex_sparsity(layout), 2) == table4


def test_density_of_dense_empty_and_scale_causal_layouts():
  assert layout_density(dense_layout(100, 70, 32, 32)) == 1.0
  assert layout_density(layout_from_mask(np.zeros((30, 20), bool), 16, 16)) == 0.0
  assert layout_density(scale_causal_layout((4,), 16, 16)) == 1.0  # one bidirectional scale
  # A token-causal 64 x 64 mask in 16-token tiles: the lower block triangle, 10 of 16.
  assert layout_density(layout_from_mask(np.tril(np.ones((64, 64), bool)), 16, 16)) == 10 / 16


@pytest.mark.parametrize('call, match', [
    (lambda: dense_layout(10, 10, 12, 16), 'block_q'),
    (lambda: layout_from_mask(np.ones(5, bool)), 'mask must be'),
    (lambda: csla_layout((1, 2, 4), sink_scales=4), 'sink_scales'),
    (lambda: csla_layout((1, 2, 4), sink_scales=1, windows=(3, 5, 7, 9)), 'windows'),
    (lambda: csla_layout((1, 2, 4), sink_scales=1, point_windows=-1), 'point_windows'),
    (lambda: csla_layout((1, 2, 4), sink_scales=1, point_windows=1), 'windows'),
    (lambda: scale_causal_layout((1, 0, 2)), 'patch_nums'),
])
def test_bad_layout_arguments_raise_clear_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()
