"""The training loop on a toy family (fast to compile): checkpoints, resume, preemption, faults.

The toy family reads the built-in dataset like the real ones and carries a model
state through its steps (as E-CAR carries GradNorm), so everything the trainer
does besides the model itself is exercised; test_train_families.py runs the real
families' tiny configs.
"""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from PIL import Image

from configs import common
from train import builtin_classifier, tasks
from train.checkpoints import CheckpointError, Checkpoints
from train.summaries import read_scalars
from train.tasks import Task, to_unit_range
from train.trainer import Preemption, Trainer, TrainingDiverged, first_step_hint

STEPS = 6


def _toy_task(config) -> Task:
  """Class logits from the mean colour of an image; model state counts the examples seen."""
  width, classes = config.model.width, config.num_classes

  def init(key):
    k1, k2 = jax.random.split(key)
    params = {'hidden': jax.random.normal(k1, (3, width)),
              'out': jax.random.normal(k2, (width, classes)) / jnp.sqrt(width)}
    return params, {'seen': jnp.zeros((), jnp.int32)}

  def inputs(frozen, batch, key):
    return jnp.mean(to_unit_range(batch['image']), axis=(1, 2)) * frozen['gain']

  def loss(params, model_state, x, labels, key):
    h = jnp.tanh(x @ params['hidden'] + 0.01 * jax.random.normal(key, (x.shape[0], width)))
    logp = jax.nn.log_softmax(h @ params['out'])
    ce = -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))
    return ce, ({}, {'seen': model_state['seen'] + labels.shape[0]})

  def sample(params, frozen, key, labels):
    colour = jax.nn.sigmoid(params['out'][:3, labels].T)
    return jnp.broadcast_to(colour[:, None, None], (labels.shape[0], config.image_size, config.image_size, 3))

  return Task('toy', config.image_size, classes, init, {'gain': jnp.float32(2.0)}, inputs, loss, sample,
              ('toy', 'frozen'))


@pytest.fixture(autouse=True, scope='module')
def toy_family():
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(tasks.BUILDERS, 'toy', _toy_task)
    yield


def toy_config(**train) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(dict(family='toy', image_size=8, num_classes=10, model=dict(width=8)))
  c.train = common.train_config(steps=STEPS, batch_size=4, lr=0.05, warmup_steps=1, ckpt_every=2, log_every=1,
                                sample_every=3, sample_classes=2, sample_per_class=2, ema_decay=0.9,
                                sample_metrics=0)
  c.train.update(train)
  c.data = common.data_config(num_examples=10, workers=0, threads=1)
  return c


class StopAt(Preemption):
  """A preemption notice that arrives after step `step`."""

  def __init__(self, step):
    super().__init__()
    self.step = step

  def __call__(self, done):
    return done >= self.step


def _assert_trees_close(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6), a, b)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The same run, uninterrupted and preempted after step 3 then resumed."""
  full_dir, cut_dir = (str(tmp_path_factory.mktemp(n)) for n in ('full', 'cut'))
  full = Trainer(toy_config(), full_dir).run()
  first = Trainer(toy_config(), cut_dir, preemption=StopAt(3)).run()
  resumed = Trainer(toy_config(), cut_dir)
  start = int(resumed.state.step)
  return dict(full_dir=full_dir, cut_dir=cut_dir, full=full, first=first, start=start, second=resumed.run())


def test_resume_after_preemption_equals_the_uninterrupted_run(runs):
  full, second = runs['full'], runs['second']
  assert runs['first'].preempted and int(runs['first'].state.step) == 3 and runs['start'] == 3
  assert not second.preempted and int(second.state.step) == STEPS
  np.testing.assert_allclose(second.last_metrics['loss'], full.last_metrics['loss'], rtol=1e-6)
  for name in ('params', 'ema_params', 'opt_state', 'model_state'):
    _assert_trees_close(getattr(second.state, name), getattr(full.state, name))
  np.testing.assert_array_equal(second.state.rng, full.state.rng)
  assert int(second.state.model_state['seen']) == STEPS * 4


def test_a_resume_with_other_data_workers_starts_the_stream_at_the_step(runs, tmp_path):
  """The checkpoint holds grain's iterator state and what it depends on; that state fits only its
  worker count, so with another the stream starts afresh at the step, with the same batches."""
  Trainer(toy_config(), str(tmp_path), preemption=StopAt(3)).run()
  data = tmp_path / 'checkpoints' / '3' / 'data' / 'process_0-of-1.json'
  assert json.loads(data.read_text()) == {'next_index': 3}   # started at step 0, it made steps 0, 1, 2
  meta = json.loads((tmp_path / 'checkpoints' / '3' / 'meta' / 'metadata').read_text())
  assert meta['data'] == {'start': 0, 'processes': 1, 'workers': 0}
  config = toy_config()
  config.data.workers = 1
  second = Trainer(config, str(tmp_path)).run()
  assert int(second.state.step) == STEPS
  _assert_trees_close(second.state.params, runs['full'].state.params)


def test_a_run_keeps_the_last_checkpoints_and_writes_grids(runs):
  workdir = runs['cut_dir']
  assert Checkpoints(workdir, 3).manager.all_steps() == [3, 4, 6]  # 3: the preemption; keep 3
  assert sorted(os.listdir(os.path.join(workdir, 'samples'))) == ['step_0000003.png', 'step_0000006.png']
  # 2 class rows of a real example and 2 samples, 8 px cells shown at 64 px with 2 px gaps.
  assert Image.open(os.path.join(workdir, 'samples', 'step_0000006.png')).size == (3 * 66 + 2, 2 * 66 + 2)
  assert Checkpoints(runs['full_dir'], 3).manager.all_steps() == [2, 4, 6]


@pytest.mark.filterwarnings('ignore:Matrix is singular')   # the toy's samples are flat colours
def test_each_grid_scores_its_samples_on_the_built_in_data(tmp_path, monkeypatch):
  monkeypatch.setattr(builtin_classifier, 'TRAIN_STEPS', 5)
  result = Trainer(toy_config(sample_metrics=3), str(tmp_path)).run()
  scalars = read_scalars(str(tmp_path / 'tensorboard'))
  accuracy, distance = scalars['samples/class_accuracy'], scalars['samples/frechet_distance']
  assert [s for s, _ in accuracy] == [s for s, _ in distance] == [3, 6]
  assert all(0 <= v <= 1 for _, v in accuracy) and all(np.isfinite(v) and v >= 0 for _, v in distance)
  assert result.sample_scores['step'] == 6
  assert result.sample_scores['class_accuracy'] == accuracy[-1][1]
  assert (tmp_path / 'builtin_classifier' / 'reference_8px_10classes.npz').exists()


def test_keep_checkpoints_bounds_what_stays_on_disk(tmp_path):
  Trainer(toy_config(keep_checkpoints=2, ckpt_every=1, sample_classes=0), str(tmp_path)).run()
  assert Checkpoints(str(tmp_path), 2).manager.all_steps() == [5, 6]


def test_a_finished_workdir_resumes_to_nothing(runs):
  again = Trainer(toy_config(), runs['full_dir']).run()
  assert int(again.state.step) == STEPS
  _assert_trees_close(again.state.params, runs['full'].state.params)


def test_sigterm_saves_and_stops_then_the_run_resumes(tmp_path):
  """The default preemption handler: SIGTERM mid-run (here from the data thread)."""
  config = toy_config(steps=40, ckpt_every=1000, sample_classes=0)
  trainer = Trainer(config, str(tmp_path))
  example = trainer.loader.example
  sent = []

  def example_then_sigterm(index, rng):
    if not sent:
      sent.append(index)
      signal.raise_signal(signal.SIGTERM)
    return example(index, rng)

  trainer.loader.example = example_then_sigterm
  previous = signal.getsignal(signal.SIGTERM)
  result = trainer.run()
  assert signal.getsignal(signal.SIGTERM) == previous  # the handler lives as long as the run
  stopped = int(result.state.step)
  assert result.preempted and stopped < 40
  assert Checkpoints(str(tmp_path), 3).latest_step() == stopped
  assert int(Trainer(config, str(tmp_path)).state.step) == stopped


def _poisoned(task):
  """The task with a NaN loss on every batch."""
  def loss(params, model_state, inputs, labels, key):
    value, aux = task.loss(params, model_state, inputs, labels, key)
    return value * jnp.nan, aux
  return dataclasses.replace(task, loss=loss)


def test_non_finite_steps_stop_the_run_and_keep_the_last_good_checkpoint(runs, tmp_path):
  shutil.copytree(runs['full_dir'], tmp_path, dirs_exist_ok=True)
  trainer = Trainer(toy_config(steps=STEPS + 6, max_bad_steps=3), str(tmp_path))
  trainer.task = _poisoned(trainer.task)
  with pytest.raises(TrainingDiverged, match='3 steps in a row .*max_bad_steps=3'):
    trainer.run()
  restored = Trainer(toy_config(steps=STEPS + 6), str(tmp_path)).state
  assert int(restored.skipped) == int(restored.step) - STEPS > 0
  _assert_trees_close(restored.params, runs['full'].state.params)


def test_an_incompatible_checkpoint_is_an_error_naming_the_difference(runs):
  wider = toy_config()
  wider.model.width = 16
  with pytest.raises(CheckpointError, match=r'does not fit this config .*hidden has shape \(3, 8\), expected \(3, 16\)'):
    Trainer(wider, runs['full_dir'])
  with pytest.raises(CheckpointError, match='batch_size=4, this run has 8'):
    Trainer(toy_config(batch_size=8), runs['full_dir'])


def test_a_corrupt_checkpoint_is_an_error_not_a_fresh_start(runs, tmp_path):
  shutil.copytree(runs['full_dir'], tmp_path, dirs_exist_ok=True)
  state_dir = tmp_path / 'checkpoints' / str(STEPS) / 'state'
  for root, _, files in os.walk(state_dir):
    for f in files:
      if f not in ('_METADATA', 'commit_success.txt'):
        with open(os.path.join(root, f), 'wb') as fh:
          fh.write(b'garbage')
  with pytest.raises(CheckpointError, match=f'checkpoints/{STEPS}.*corrupt'):
    Trainer(toy_config(), str(tmp_path))


@pytest.mark.parametrize('key, value, match', [
    ('lr', -1.0, 'config.train.lr must be a positive number'),
    ('schedule', 'step', 'config.train.schedule must be one of'),
    ('grad_accum', 3, 'config.train.batch_size must be a multiple of config.train.grad_accum=3'),
    ('warmup_steps', -1, r'config.train.warmup_steps must be an integer >= 0'),
    ('ema_decay', 1.0, r'config.train.ema_decay must be in \[0, 1\)'),
    ('mesh_fsdp', 3, 'config.train.mesh_fsdp=3 must be >= 1 and divide the 1 devices'),
    ('mesh_data', 2, 'config.train.mesh_data=2 x mesh_fsdp=1 must equal the 1 devices'),
    ('max_bad_steps', 0, 'config.train.max_bad_steps must be an integer >= 1'),
    ('sample_metrics', -1, 'config.train.sample_metrics must be an integer >= 0'),
])
def test_a_bad_train_setting_is_an_error_naming_the_key(tmp_path, key, value, match):
  with pytest.raises(ValueError, match=match):
    Trainer(toy_config(**{key: value}), str(tmp_path))
  assert not os.path.exists(tmp_path / 'checkpoints')


@pytest.mark.parametrize('key, value, match', [
    ('source', 'laion', 'config.data.source must be one of'),
    ('crop', 'middle', 'config.data.crop must be one of'),
    ('path', '', "config.data.path must be the image folder"),
    ('cache_latents', True, 'config.data.cache_latents must be False for this family'),
])
def test_a_bad_data_setting_is_an_error_naming_the_key(tmp_path, key, value, match):
  config = toy_config()
  config.data.update({key: value, **({'source': 'folder'} if key == 'path' else {})})
  with pytest.raises(ValueError, match=match):
    Trainer(config, str(tmp_path))


def test_an_unknown_family_is_an_error(tmp_path):
  config = toy_config()
  config.family = 'gan'
  with pytest.raises(ValueError, match="config.family must be one of"):
    Trainer(config, str(tmp_path))


def test_the_command_line_rejects_a_bad_value_before_compiling(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get('PYTHONPATH', '')]), JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, '-m', 'train', '--config', 'configs/var.py:tiny', '--workdir',
                         str(tmp_path / 'run'), '--config.train.ema_decay=1.5'],
                        cwd=repo, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert 'config.train.ema_decay must be in [0, 1), got 1.5' in proc.stderr
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints')


def test_a_run_on_an_image_folder(tmp_path):
  from PIL import Image
  for label, colour in enumerate(((250, 10, 10), (10, 10, 250))):
    os.makedirs(tmp_path / 'images' / f'class_{label}')
    for i in range(3):
      Image.fromarray(np.full((20 + i, 24, 3), colour, np.uint8)).save(tmp_path / 'images' / f'class_{label}' / f'{i}.jpg')
  config = toy_config(steps=2, sample_classes=0)
  config.data.update(source='folder', path=str(tmp_path / 'images'))
  trainer = Trainer(config, str(tmp_path / 'run'))
  batch = trainer.loader.batch(0)
  assert batch['image'].shape == (4, 8, 8, 3) and set(batch['label'].tolist()) <= {0, 1}
  assert int(trainer.run().state.step) == 2


@pytest.mark.parametrize('backend, flags, hinted', [
    ('cudnn', '--xla_gpu_deterministic_ops=true', True), ('cudnn', '--xla_gpu_deterministic_ops', True),
    ('cudnn', '--xla_gpu_deterministic_ops=false', False), ('xla', '--xla_gpu_deterministic_ops=true', False),
    ('cudnn', '', False)])
def test_a_first_step_failing_under_deterministic_gpu_ops_with_cudnn_attention_names_the_fix(backend, flags, hinted):
  config = ml_collections.ConfigDict({'attn_backend': backend})
  hint = first_step_hint(config, f'--xla_dump_to=/tmp/x {flags}')
  assert (hint is not None and '--config.attn_backend=xla' in hint) == hinted
