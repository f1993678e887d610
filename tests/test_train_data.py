"""Training data: the built-in shapes, the image folder, crops, deterministic per-host batches."""
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from train.data import synthetic
from train.data.folder import ImageFolder
from train.data.loader import Loader
from train.data.sources import image_examples
from train.data.transforms import center_crop, preprocess, random_crop

REPO = pathlib.Path(__file__).resolve().parent.parent


def _foreground(img: np.ndarray) -> np.ndarray:
  """Pixels far from the background shade (the shape), bool [H, W]."""
  corners = np.stack([img[0, 0], img[0, -1], img[-1, 0], img[-1, -1]]).astype(np.float32)
  return np.abs(img.astype(np.float32) - np.median(corners, 0)).sum(-1) > 100


def test_synthetic_is_deterministic_from_seed_and_index():
  a = synthetic.SyntheticShapes(10, 24, 100, seed=3)
  b = synthetic.SyntheticShapes(10, 24, 100, seed=3)
  other = synthetic.SyntheticShapes(10, 24, 100, seed=4)
  for i in (0, 7, 55):
    np.testing.assert_array_equal(a.load(i)[0], b.load(i)[0])
  assert not np.array_equal(a.load(7)[0], other.load(7)[0])
  assert not np.array_equal(a.load(7)[0], a.load(17)[0])  # same class, its own pose
  assert a.load(7)[1] == a.load(17)[1] == 7


@pytest.mark.parametrize('size', [8, 33, 64])
def test_synthetic_renders_any_resolution(size):
  img, label = synthetic.SyntheticShapes(12, size, 50, seed=0).load(5)
  assert img.shape == (size, size, 3) and img.dtype == np.uint8 and label == 5


def test_synthetic_classes_differ_in_shape_and_colour():
  styles = [synthetic.class_style(k) for k in range(12)]
  assert len({s for s, _ in styles}) == 12
  assert len({tuple(c) for _, c in styles}) == 12
  ds = synthetic.SyntheticShapes(12, 64, 1000, seed=0)
  colours, masks = [], []
  for k in range(12):
    img, _ = ds.load(k)
    fg = _foreground(img)
    assert fg.sum() > 40, f'class {k} draws no visible shape'
    colours.append(img[fg].mean(0))
    masks.append(fg)
  dist = np.linalg.norm(np.array(colours)[:, None] - np.array(colours)[None], axis=-1)
  assert dist[~np.eye(12, dtype=bool)].min() > 30   # mean shape colours are apart (0..255 scale)
  assert len({m.sum() for m in masks}) >= 10         # the shapes cover different areas


def test_synthetic_rejects_too_many_classes():
  with pytest.raises(ValueError, match='at most 144 classes'):
    synthetic.SyntheticShapes(1000, 32, 10, seed=0)


def test_center_crop_keeps_the_middle_and_random_crop_stays_inside():
  img = np.zeros((40, 80, 3), np.uint8)
  img[:, 20:60] = 255
  out = center_crop(img, 20)
  assert out.shape == (20, 20, 3) and out.min() > 200
  rng = np.random.default_rng(0)
  crops = [random_crop(img, 16, rng) for _ in range(4)]
  assert all(c.shape == (16, 16, 3) for c in crops)
  with pytest.raises(ValueError, match='config.data.crop'):
    preprocess(img, 16, 'middle', False, rng)


def test_flip_is_random_per_example_and_reproducible():
  img = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
  flips = [preprocess(img, 4, 'center', True, np.random.default_rng(s)) for s in range(16)]
  flipped = [np.array_equal(f, img[:, ::-1]) for f in flips]
  assert 0 < sum(flipped) < 16
  again = [preprocess(img, 4, 'center', True, np.random.default_rng(s)) for s in range(16)]
  assert all(np.array_equal(a, b) for a, b in zip(flips, again))


def _loader(hosts=1, index=0, batch=8, n=20, seed=0, workers=0):
  ds = synthetic.SyntheticShapes(10, 8, n, seed=0)
  return Loader(image_examples(ds, 8, 'center', True), n, global_batch=batch, seed=seed, steps=10,
                process_index=index, process_count=hosts, workers=workers, threads=2)


def _take(iterator, count: int) -> list[dict]:
  try:
    return [next(iterator) for _ in range(count)]
  finally:
    iterator.close()


def test_two_hosts_read_disjoint_halves_of_the_single_host_batch():
  one = _loader()
  hosts = [_loader(hosts=2, index=i) for i in range(2)]
  for step in (0, 2, 5):  # 5 straddles an epoch boundary (20 examples, batch 8)
    full = one.batch(step)
    halves = [h.batch(step) for h in hosts]
    for k in ('image', 'label'):
      np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), full[k])
    assert halves[0]['image'].shape[0] == 4


def test_each_epoch_is_a_permutation_and_epochs_differ():
  ld = _loader(batch=5, n=20)
  seen = [ld.local_indices(s)[1] for s in range(8)]
  first, second = np.concatenate(seen[:4]), np.concatenate(seen[4:])
  assert sorted(first) == list(range(20)) and sorted(second) == list(range(20))
  assert not np.array_equal(first, second)


def test_two_hosts_with_worker_processes_split_every_epoch_between_them():
  """Each host's pipeline, in 2 worker processes, over 2 epochs (20 examples, batch 4): within an
  epoch the hosts never read the same example and together read every one."""
  seen = []
  for host in range(2):
    batches = _take(_loader(hosts=2, index=host, batch=4, workers=2).iterator(0), 10)
    seen.append(np.concatenate([b['position'] for b in batches]))
  ld = _loader(batch=4)
  for epoch in range(2):
    reads = [ld.stream[int(p)][2] for p in np.sort(np.concatenate(seen)) if p // 20 == epoch]
    per_host = [{ld.stream[int(p)][2] for p in s if p // 20 == epoch} for s in seen]
    assert not per_host[0] & per_host[1]
    assert sorted(reads) == list(range(20))


def test_worker_processes_make_the_batches_the_training_process_makes():
  ld = _loader()
  in_process, workers = _take(ld.iterator(2), 3), _take(_loader(workers=2).iterator(2), 3)
  for step, a, b in zip((2, 3, 4), in_process, workers):
    np.testing.assert_array_equal(a['position'], ld.local_positions(step))
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_array_equal(a['image'], ld.batch(step)['image'])


def test_a_restored_iterator_state_continues_where_the_saved_one_stopped():
  ld = _loader(workers=2)
  it = ld.iterator(1)
  next(it), next(it)
  state = it.get_state()
  want = _take(it, 2)
  again = ld.iterator(1)
  again.set_state(state)
  got = _take(again, 2)
  for a, b in zip(want, got):
    np.testing.assert_array_equal(a['position'], b['position'])
    np.testing.assert_array_equal(a['image'], b['image'])
  np.testing.assert_array_equal(got[0]['position'], ld.local_positions(3))


def test_loader_surfaces_a_failing_example():
  def broken(index, rng):
    raise OSError(f'cannot read example {index}')
  with pytest.raises(OSError, match='cannot read example'):
    _take(Loader(broken, 10, global_batch=2, seed=0, steps=5).iterator(0), 1)


def test_global_batch_must_divide_over_hosts():
  with pytest.raises(ValueError, match='batch_size=9 must divide over 2 hosts'):
    _loader(hosts=2, batch=9)


def test_image_folder_labels_by_sorted_subfolder(tmp_path):
  for name, colour in (('zebra', 200), ('apple', 50)):
    (tmp_path / name).mkdir()
    for i in range(2):
      Image.fromarray(np.full((12, 16, 3), colour + i, np.uint8)).save(tmp_path / name / f'{i}.png')
  (tmp_path / 'apple' / 'notes.txt').write_text('not an image')
  ds = ImageFolder(str(tmp_path))
  assert ds.classes == ['apple', 'zebra'] and len(ds) == 4
  example = image_examples(ds, 8, 'center', False)
  out = [example(i, np.random.default_rng(0)) for i in range(4)]
  assert [o['label'] for o in out] == [0, 0, 1, 1]
  assert out[2]['image'].shape == (8, 8, 3) and int(out[2]['image'][0, 0, 0]) == 200


def test_image_folder_errors_name_the_key(tmp_path):
  with pytest.raises(ValueError, match='config.data.path=.* is not a directory'):
    ImageFolder(str(tmp_path / 'missing'))
  with pytest.raises(ValueError, match='no class sub-folders'):
    ImageFolder(str(tmp_path))


_KILLED_PARENT = '''
import os, sys, time
import numpy as np
sys.path.insert(0, os.getcwd())
from train.data.loader import Loader

def example(index, rng):
  return {'pid': np.int64(os.getpid())}

if __name__ == '__main__':
  data = Loader(example, 8, global_batch=2, seed=0, steps=1000, workers=2, threads=1).iterator(0)
  print(' '.join(str(p) for p in sorted({int(p) for _ in range(6) for p in next(data)['pid']})), flush=True)
  time.sleep(600)
'''


def _running(pid: int) -> bool:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


@pytest.mark.skipif(not os.path.isdir('/proc'), reason='reads process states from /proc')
def test_worker_processes_exit_when_the_training_process_is_killed_alone(tmp_path):
  script = tmp_path / 'train.py'
  script.write_text(_KILLED_PARENT)
  proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    workers = [int(p) for p in proc.stdout.readline().split()]
    assert len(workers) == 2 and proc.pid not in workers and all(map(_running, workers))
  finally:
    proc.kill()   # SIGKILL to the training process only, as the OOM killer sends it
    proc.wait()
  deadline = time.monotonic() + 20
  while any(map(_running, workers)) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not any(map(_running, workers))
