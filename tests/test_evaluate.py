"""`python -m train.evaluate` on the tiny VAR (random weights, built-in data): ADM-format shards with balanced
classes, resuming a killed run, the Inception metrics (through a small stand-in network: the real one, its
checkpoint and its outputs are tests/test_inception.py's), built-in metrics, flag errors."""
import json
import os
import pathlib
import shutil

import flax.linen as nn
import jax
import numpy as np
import pytest
from absl import flags

from conftest import random_tiny_var_checkpoint
from train import builtin_classifier, evaluate

CONFIG = str(pathlib.Path(__file__).resolve().parent.parent / 'configs' / 'var.py') + ':tiny'
CLASSES, PER_CLASS, BATCH = 10, 2, 8   # 20 images: calls of 8, 8 and 4 (padded)


@pytest.fixture(scope='module')
def run_evaluate(tmp_path_factory):
  """run(out, *flags) -> results.json: main() in this process (so tests can monkeypatch), flags reset to
  their defaults before and after, on a checkpoint of the tiny VAR with random weights drawn without compiling its
  initialisers (each run's own random init would compile them again: ~6 s a run)."""
  ckpt = random_tiny_var_checkpoint(str(tmp_path_factory.mktemp('ckpt')))

  def run(out, *args):
    flags.FLAGS.unparse_flags()
    try:
      flags.FLAGS(['evaluate', '--config', CONFIG, '--ckpt', ckpt, '--out', str(out), '--per_class', str(PER_CLASS),
                   '--batch_size', str(BATCH), '--seed', '3', *args])
      evaluate.main([])
    finally:
      flags.FLAGS.unparse_flags()   # the next test in this process finds every flag at its default
    with open(os.path.join(out, 'results.json')) as f:
      return json.load(f)
  return run


def _shards(directory):
  return sorted(p for p in os.listdir(directory) if p.startswith('samples_'))


@pytest.fixture(scope='module')
def sampled(tmp_path_factory, run_evaluate):
  """An --out directory with the 20 samples at cfg 1.5 (the config's) and their results.json."""
  out = tmp_path_factory.mktemp('eval')
  run_evaluate(out, '--nobuiltin')
  return out


@pytest.fixture
def copy(sampled, tmp_path):
  shutil.copytree(sampled, tmp_path, dirs_exist_ok=True)
  return tmp_path


def test_shards_are_adm_npz_with_every_class_equally_often(sampled):
  names = _shards(sampled / 'cfg_1.5')
  assert names == ['samples_0_00000.npz', 'samples_0_00001.npz', 'samples_0_00002.npz']
  shards = [np.load(sampled / 'cfg_1.5' / n) for n in names]
  assert [len(s['arr_0']) for s in shards] == [8, 8, 4]
  assert all(s['arr_0'].dtype == np.uint8 and s['arr_0'].shape[1:] == (32, 32, 3) for s in shards)
  np.testing.assert_array_equal(np.concatenate([s['arr_1'] for s in shards]), np.repeat(np.arange(CLASSES), 2))
  row = json.loads((sampled / 'results.json').read_text())['cfg_1.5']
  assert row['images'] == 20 and row['sec_per_image'] > 0 and 'fid' not in row


def test_a_rerun_samples_only_the_missing_shard_and_the_same_bytes(copy, run_evaluate):
  directory = copy / 'cfg_1.5'
  last = directory / 'samples_0_00002.npz'
  want, kept = last.read_bytes(), {n: os.stat(directory / n).st_mtime_ns for n in _shards(directory)[:2]}
  last.unlink()
  run_evaluate(copy, '--nobuiltin')
  assert last.read_bytes() == want
  assert kept == {n: os.stat(directory / n).st_mtime_ns for n in _shards(directory)[:2]}
  with pytest.raises(ValueError, match='holds samples drawn with .* use another --out'):
    run_evaluate(copy, '--nobuiltin', '--seed', '4')


def test_each_guidance_scale_is_a_run_of_its_own_with_the_same_parameters(copy, tmp_path_factory, run_evaluate):
  rows = run_evaluate(copy, '--nobuiltin', '--cfg', '1.5,3')
  assert sorted(rows) == ['cfg_1.5', 'cfg_3'] and rows['cfg_3']['options']['cfg'] == 3.0
  alone = tmp_path_factory.mktemp('cfg_3_alone')
  run_evaluate(alone, '--nobuiltin', '--cfg', '3')
  names = _shards(copy / 'cfg_3')
  assert names == _shards(alone / 'cfg_3') and len(names) == 3
  for name in names:
    assert (copy / 'cfg_3' / name).read_bytes() == (alone / 'cfg_3' / name).read_bytes()


class _SmallInception(nn.Module):
  """FIDInceptionV3's outputs, 16 / 10 / 12 wide: the real network's 2048-wide FID costs a CPU ~20 s
  (its matrix square root), and tests/test_inception.py checks the network itself."""

  @nn.compact
  def __call__(self, images):
    x = images.reshape(len(images), -1)
    pool = nn.Dense(16)(x)
    return {'pool': pool, 'logits': nn.Dense(10)(pool), 'spatial': nn.Dense(12)(x)}


def test_inception_metrics_are_finite_and_the_reference_is_cached(copy, monkeypatch, run_evaluate):
  model = _SmallInception()
  params = model.init(jax.random.key(0), np.zeros((1, 32, 32, 3)))['params']
  loads = []
  monkeypatch.setattr(evaluate, 'load_inception', lambda d: loads.append(d) or (model, params))
  ref = str(copy / 'ref.npz')
  np.savez(ref, arr_0=np.random.default_rng(0).integers(0, 256, (12, 32, 32, 3), np.uint8))
  args = ('--nobuiltin', '--ref', ref, '--inception', str(copy), '--cfg', '1.5')
  row = run_evaluate(copy, *args)['cfg_1.5']
  for k in ('fid', 'sfid', 'is', 'precision', 'recall'):
    assert np.isfinite(row[k]), k
  assert 0 <= row['precision'] <= 1 and 0 <= row['recall'] <= 1
  with np.load(copy / 'reference_ref.npz') as f:
    assert f['pool'].shape == (12, 16) and f['mu_s'].shape == (12,)
  np.savez(ref, arr_0=np.zeros((1, 32, 32, 3), np.uint8))   # the cache, not the file, is read again
  assert run_evaluate(copy, *args)['cfg_1.5']['fid'] == row['fid'] and loads == [str(copy)] * 2


def test_builtin_metrics_are_on_by_default_for_a_model_of_the_built_in_data(copy, monkeypatch, run_evaluate):
  monkeypatch.setattr(builtin_classifier, 'TRAIN_STEPS', 20)
  monkeypatch.setattr(builtin_classifier, 'REFERENCE_SIZE', 50)
  row = run_evaluate(copy)['cfg_1.5']
  assert 0 <= row['class_accuracy'] <= 1 and np.isfinite(row['frechet_distance'])
  assert (copy / 'builtin_classifier').is_dir()   # --ckpt is not a training workdir: trained into --out


@pytest.mark.parametrize('args,error', [
    (['--num_samples', '15'], r'--num_samples=15 must be a multiple of the 10 classes'),
    (['--num_samples', '1'], r'--num_samples must be >= 2'),
    (['--cfg', '1.5,x'], r'--cfg must be numbers'),
    (['--policy', 'lazymar:official'], r'accelerates MAR samplers'),
    (['--ref', 'REF'], r'--ref needs --inception'),
    (['--inception', 'CKPT'], r'--inception needs --ref'),
    (['--ref', 'NOARR', '--inception', 'CKPT'], r'--ref .* no arr_0'),
    (['--num_iter', '4'], r'--num_iter applies to MAR configs')])
def test_bad_flags_are_named_before_anything_is_sampled(tmp_path, args, error, run_evaluate):
  np.savez(tmp_path / 'ref.npz', arr_0=np.zeros((2, 8, 8, 3), np.uint8))
  np.savez(tmp_path / 'noarr.npz', mu=np.zeros(3))
  subs = {'REF': str(tmp_path / 'ref.npz'), 'NOARR': str(tmp_path / 'noarr.npz'), 'CKPT': str(tmp_path)}
  with pytest.raises(ValueError, match=error):
    run_evaluate(tmp_path / 'out', '--nobuiltin', *(subs.get(a, a) for a in args))
  assert not (tmp_path / 'out').exists() or not any((tmp_path / 'out').iterdir())
