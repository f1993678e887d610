"""var_models.var.schedules: token counts, offsets, level ids, validation."""
import numpy as np
import pytest

from var_models.var import schedules
from var_models.var.schedules import INFINITY_1024, VAR_256, VAR_512, ScaleSchedule, get_schedule


@pytest.mark.parametrize('sched,L,n', [(VAR_256, 680, 10), (VAR_512, 2240, 10), (INFINITY_1024, 10521, 13)])
def test_total_tokens_and_num_scales(sched, L, n):
  assert sched.L == L
  assert sched.num_scales == n
  assert sched.lengths == tuple(p * p for p in sched.patch_nums)


def test_var_256_patch_nums_and_final_hw():
  assert VAR_256.patch_nums == (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
  assert VAR_256.final_hw == 16 and VAR_256.first_l == 1
  assert VAR_512.final_hw == 32 and INFINITY_1024.final_hw == 64


def test_begin_ends_var_256():
  be = VAR_256.begin_ends
  assert be[:4] == ((0, 1), (1, 5), (5, 14), (14, 30))
  assert be[-1] == (680 - 256, 680)
  assert all(isinstance(i, int) for pair in be for i in pair)


@pytest.mark.parametrize('sched', [VAR_256, VAR_512, INFINITY_1024])
def test_begin_ends_are_contiguous_and_sized(sched):
  be = sched.begin_ends
  assert be[0][0] == 0 and be[-1][1] == sched.L
  for (b0, e0), (b1, _) in zip(be, be[1:]):
    assert e0 == b1
  assert tuple(e - b for b, e in be) == sched.lengths


@pytest.mark.parametrize('sched', [VAR_256, VAR_512, INFINITY_1024])
def test_level_ids_match_begin_ends(sched):
  lv = sched.level_ids()
  assert lv.shape == (sched.L,) and lv.dtype == np.int32
  for s, (b, e) in enumerate(sched.begin_ends):
    assert (lv[b:e] == s).all()
  assert (np.diff(lv) >= 0).all()


def test_level_ids_small_schedule():
  np.testing.assert_array_equal(ScaleSchedule((1, 2, 3)).level_ids(),
                                [0] + [1] * 4 + [2] * 9)


def test_patch_nums_are_normalised_to_int_tuple():
  s = ScaleSchedule([1, np.int64(2), 4])
  assert s.patch_nums == (1, 2, 4) and all(type(p) is int for p in s.patch_nums)
  assert s == ScaleSchedule((1, 2, 4)) and hash(s) == hash(ScaleSchedule((1, 2, 4)))


@pytest.mark.parametrize('bad', [(), (0, 1, 2), (1, -2, 3), (1, 2, 2), (1, 3, 2)])
def test_bad_patch_nums_raise_value_error(bad):
  with pytest.raises(ValueError, match='patch_nums'):
    ScaleSchedule(bad)


def test_image_size_and_check_image_size():
  assert VAR_256.image_size(16) == 256
  assert VAR_512.image_size(16) == 512
  assert INFINITY_1024.image_size(16) == 1024
  VAR_256.check_image_size(256, 16)  # does not raise


@pytest.mark.parametrize('sched,size', [(VAR_256, 512), (VAR_512, 256), (INFINITY_1024, 768)])
def test_check_image_size_raises_naming_the_size(sched, size):
  with pytest.raises(ValueError, match=rf'\b{size}\b') as info:
    sched.check_image_size(size, 16)
  assert str(sched.image_size(16)) in str(info.value)


def test_get_schedule_by_name_tuple_and_instance():
  assert get_schedule('var_256') is VAR_256
  assert get_schedule('var_512') is VAR_512
  assert get_schedule('infinity_1024') is INFINITY_1024
  assert get_schedule(VAR_512) is VAR_512
  assert get_schedule((1, 2, 3)) == ScaleSchedule((1, 2, 3))
  assert set(schedules.NAMED) == {'var_256', 'var_512', 'infinity_1024'}


def test_get_schedule_unknown_name_raises_value_error():
  with pytest.raises(ValueError, match='var_1024'):
    get_schedule('var_1024')
