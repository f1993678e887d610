"""`python -m train` (and `python -m train.evaluate`) as 2 processes of 2 CPU devices each, joined by
JAX's distributed runtime.

The runs use the two launch recipes of train/multihost.py: the coordinator-address
variables, and SLURM's variables (faked here as srun would set them). Each process
starts in its own session, as a scheduler's job step does, and a signal goes to the
whole session (the grain workers too). The E-CAR and MAR training runs and the evaluation
are compared with one process of 4 devices on the same (data 2, fsdp 2) mesh, global batch
and seed.
"""
import importlib.util
import json
import os
import shutil
import signal
import time

import numpy as np
import pytest

from conftest import JOB_XLA_FLAGS, TEST_XLA_FLAGS, random_tiny_var_checkpoint
from imagenet_tars import write_tars
from train import builtin_classifier, launch
from train.builtin_classifier import BuiltinMetrics
from train.summaries import read_scalars

STEPS = 12
SMALL = ['--config.train.batch_size=8', '--config.train.log_every=1', '--config.train.ckpt_every=1000',
         '--config.train.sample_classes=0', '--config.train.mesh_fsdp=2', '--config.data.threads=1']
# The tiny E-CAR at one AR and one denoiser block per stage, on 2 stages at 16 px (at its width, so that
# fsdp still splits its matrices): what is compared does not depend on depth or on the number of stages,
# and each process compiles and steps faster.
ECAR_MODEL = ['--config=configs/ecar.py:tiny', '--config.model.ar_depth=1', '--config.model.den_depth=1',
              '--config.image_size=16', '--config.model.num_stages=2']
ECAR = [*ECAR_MODEL, f'--config.train.steps={STEPS}', '--config.data.workers=1', *SMALL]
# MAR's tiny config at 4 px (2 x 2 tokens), a VAE of one downsampling, one encoder and one head block: the
# cache's parts and the losses compared do not depend on the model's size.
MAR_MODEL = ['--config.model.img_size=4', '--config.model.vae_stride=2', '--config.vae.ch_mult=(1,1)',
             '--config.model.encoder_depth=1', '--config.model.diffloss_d=1', '--config.sample.num_iter=2']
# The tiny VAR at one block: what is checked does not depend on depth.
VAR = ['--config=configs/var.py:tiny', '--config.model.depth=1', '--config.train.steps=3', *SMALL]


def _job(workdir, args, n=2, launch_env=launch.coordinator_env, per_process=None, run=('-m', 'train'),
         xla_flags=JOB_XLA_FLAGS):
  """n processes of `python *run *args *per_process[i]` with 4 / n CPU devices each (default per-process
  arguments: --workdir=workdir); logs in workdir/logs. xla_flags: JOB_XLA_FLAGS (faster compiles) where the
  test compares the job with other jobs alone, TEST_XLA_FLAGS where it also compares it with what it computes."""
  per_process = per_process or [[f'--workdir={workdir}']] * n
  env = {'JAX_PLATFORMS': 'cpu', 'JAX_NUM_CPU_DEVICES': str(4 // n), 'XLA_FLAGS': xla_flags}
  return launch.Job(workdir / 'logs', [[*run, *args, *extra] for extra in per_process], [env] * n, launch_env)


def _losses(workdir) -> dict:
  """{step: loss} from the run's TensorBoard events (a resumed run's later values win)."""
  return dict(read_scalars(str(workdir / 'tensorboard'))['loss'])


def _assert_same_losses(got: dict, want: dict, steps) -> None:
  # One process reduces over its 4 devices in XLA, two over gloo: the sums may round differently.
  np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-6)


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
  """The E-CAR run as 1 process of 4 devices: {step: loss}."""
  workdir = tmp_path_factory.mktemp('one')
  _job(workdir, ECAR, n=1).succeed(timeout=300)
  return _losses(workdir)


@pytest.fixture(scope='module')
def preempted(tmp_path_factory):
  """The E-CAR run as 2 processes (coordinator address), SIGTERM to both after step 3, then the
  same commands under SLURM's variables to the end."""
  workdir = tmp_path_factory.mktemp('two')
  job = _job(workdir, ECAR)
  job.wait_for_step(3, timeout=300)
  for i in range(2):
    job.signal(i, signal.SIGTERM)
  job.succeed(timeout=300)
  outs = [job.out(i) for i in range(2)]
  checkpoints = sorted(os.listdir(workdir / 'checkpoints'))
  data_files = sorted(os.listdir(workdir / 'checkpoints' / checkpoints[-1] / 'data'))
  losses_before = _losses(workdir)
  _job(workdir, ECAR, launch_env=launch.slurm_env).succeed(timeout=300)
  return dict(workdir=workdir, outs=outs, checkpoints=checkpoints, data_files=data_files,
              losses_before=losses_before, losses=_losses(workdir))


def test_two_processes_take_the_steps_of_one_process_with_four_devices(preempted, one_process):
  stopped = int(preempted['checkpoints'][-1])
  assert sorted(preempted['losses_before']) == list(range(1, stopped + 1))
  _assert_same_losses(preempted['losses_before'], one_process, range(1, stopped + 1))


def test_sigterm_to_both_leaves_one_checkpoint_and_the_same_commands_resume_to_the_same_losses(
    preempted, one_process):
  [stopped] = preempted['checkpoints']
  assert 3 <= int(stopped) < STEPS
  assert all(f'stopped at step {stopped} on SIGTERM' in out for out in preempted['outs'])
  assert {'process_0-of-2.json', 'process_1-of-2.json'} <= set(preempted['data_files'])
  assert sorted(map(int, os.listdir(preempted['workdir'] / 'checkpoints'))) == [int(stopped), STEPS]
  _assert_same_losses(preempted['losses'], one_process, range(int(stopped) + 1, STEPS + 1))


def test_the_checkpoint_of_two_processes_resumes_on_one_process(preempted, one_process, tmp_path):
  """The step the two processes saved on SIGTERM, resumed by one process of 4 devices (its grain state
  fits only two processes: the stream restarts at the step)."""
  stopped = preempted['checkpoints'][0]
  workdir = tmp_path / 'resumed'
  (workdir / 'checkpoints').mkdir(parents=True)
  shutil.copytree(preempted['workdir'] / 'checkpoints' / stopped, workdir / 'checkpoints' / stopped)
  shutil.copy(preempted['workdir'] / 'config.json', workdir)
  _job(workdir, ECAR, n=1).succeed(timeout=300)
  _assert_same_losses(_losses(workdir), one_process, range(int(stopped) + 1, STEPS + 1))


def test_the_exported_params_are_written_once_and_load_with_train_sample(preempted):
  workdir = preempted['workdir']
  assert json.loads((workdir / 'meta.json').read_text())['step'] == STEPS
  out = workdir / 'grid.png'
  _job(workdir, [*ECAR_MODEL, '--config.sample.num_steps=3', f'--ckpt={workdir}',
                '--labels=0,1', f'--out={out}'], n=1, per_process=[[]], run=('-m', 'train.sample')).succeed(timeout=300)
  assert out.stat().st_size > 0


EPOCH_READER = r'''
import json, sys
import jax
from train import multihost
multihost.initialize()
from configs import ecar
from train.data.loader import Loader
from train.data.sources import make_examples
from train.tasks import make_task

config = ecar.get_config('tiny')
config.data.num_examples = 40
example, n = make_examples(config, make_task(config), sys.argv[1])
loader = Loader(example, n, global_batch=8, seed=0, steps=10, process_index=jax.process_index(),
                process_count=jax.process_count(), workers=1, threads=1)
data = loader.iterator(0)
positions = [int(p) for _ in range(10) for p in next(data)['position']]
data.close()
examples = [int(loader.stream.order(p // n)[p % n]) for p in positions]
print(json.dumps({'positions': positions, 'examples': examples}))
'''


def test_two_processes_split_every_epoch_between_them(tmp_path):
  """Each process's pipeline (worker processes) over 2 epochs of 40 examples at global batch 8: within an
  epoch no example is read by both and together they read every one."""
  job = _job(tmp_path, [str(tmp_path)], per_process=[[], []], run=('-c', EPOCH_READER))
  job.succeed(timeout=300)
  reads = [json.loads(job.out(i).strip().splitlines()[-1]) for i in range(2)]
  for epoch in range(2):
    per_process = [{e for p, e in zip(r['positions'], r['examples']) if p // 40 == epoch} for r in reads]
    assert not per_process[0] & per_process[1]
    assert per_process[0] | per_process[1] == set(range(40))


def test_a_killed_process_makes_the_other_exit_with_an_error_naming_it(tmp_path):
  job = _job(tmp_path, [*ECAR, '--config.train.steps=10000', '--heartbeat_timeout=10'])
  job.wait_for_step(2, timeout=300)
  job.signal(1, signal.SIGKILL)
  start = time.monotonic()
  code = job.wait(timeout=120)[0]
  assert code != 0 and time.monotonic() - start < 60
  err = job.err(0)
  assert 'Another process has probably died' in err and 'Task 1 heartbeat timeout' in err


def test_tiny_var_on_two_processes_scores_its_samples_on_process_0_while_the_other_waits(tmp_path):
  """Process 0 trains the built-in classifier alone (tens of seconds) at the first grid; the other
  process waits for it and both finish. (Two processes taking one process's steps
  is checked on E-CAR and MAR, whose loaders and steps VAR's share.)"""
  job = _job(tmp_path, [*VAR, '--config.train.sample_classes=3'])
  job.succeed(timeout=300)
  assert sorted(_losses(tmp_path)) == [1, 2, 3]
  assert os.listdir(tmp_path / 'samples') == ['step_0000003.png']
  assert "samples at step 3, scored by the built-in data's classifier" in job.out(0)


def test_mar_on_cached_latents_encodes_a_part_per_process_and_takes_the_steps_of_one(tmp_path):
  mar = ['--config=configs/mar.py:tiny', '--config.train.steps=3', *SMALL, '--config.data.cache_latents=True',
         '--config.data.num_examples=24', *MAR_MODEL]
  _job(tmp_path / 'one', mar, n=1).succeed(timeout=300)
  _job(tmp_path / 'two', mar).succeed(timeout=300)
  [cache] = (tmp_path / 'two' / 'latents').iterdir()
  assert sorted(os.listdir(cache)) == ['labels-0.npy', 'labels-1.npy', 'meta.json', 'moments-0.npy', 'moments-1.npy']
  _assert_same_losses(_losses(tmp_path / 'two'), _losses(tmp_path / 'one'), range(1, 4))


@pytest.mark.skipif(importlib.util.find_spec('tensorflow') is None,
                    reason='preparing imagenet2012 needs TensorFlow (the `data` extra)')
def test_process_0_prepares_imagenet_from_the_tars_while_the_other_waits(tmp_path):
  write_tars(str(tmp_path / 'manual'))
  args = ['--config=configs/ecar.py:tiny', '--config.train.steps=3', *SMALL, '--config.train.batch_size=4',
          '--config.num_classes=1000', '--config.data.source=imagenet', f'--config.data.path={tmp_path}/tfds',
          f'--config.data.manual_dir={tmp_path}/manual', '--config.data.workers=1']
  job = _job(tmp_path / 'run', args)
  job.succeed(timeout=300)
  assert 'waiting for process 0 to prepare imagenet2012' in job.err(1)
  assert sorted(_losses(tmp_path / 'run')) == [1, 2, 3]


def test_evaluate_on_two_processes_writes_each_shard_once_as_one_process_does(tmp_path, monkeypatch):
  """Process 0 samples call 0, process 1 calls 1 and 2, then process 0 alone scores them all. The weights:
  random, in a checkpoint (each process's own random init would compile the initialisers). The built-in
  classifier: trained for 20 steps, saved as the full training's in the checkpoint's folder, where
  evaluate loads it (the full training would take half the test; the scores are compared, not judged)."""
  random_tiny_var_checkpoint(str(tmp_path / 'ckpt'))
  train = builtin_classifier.train_classifier
  monkeypatch.setattr(builtin_classifier, 'train_classifier', lambda size, seed, steps: train(size, seed, 20))
  builtin = BuiltinMetrics.load_or_train(str(tmp_path / 'ckpt'), 32, 10)
  args = ['--config=configs/var.py:tiny', f'--ckpt={tmp_path / "ckpt"}', '--per_class=2', '--batch_size=8', '--seed=3']
  outs = {n: tmp_path / f'{n}' / 'out' for n in (1, 2)}
  evaluate = dict(run=('-m', 'train.evaluate'), xla_flags=TEST_XLA_FLAGS)   # the scores are recomputed here
  _job(tmp_path / '1', [*args, '--nobuiltin'], n=1, per_process=[[f'--out={outs[1]}']], **evaluate).succeed(timeout=300)
  _job(tmp_path / '2', args, per_process=[[f'--out={outs[2]}']] * 2, **evaluate).succeed(timeout=300)
  shards = sorted(n for n in os.listdir(outs[2] / 'cfg_1.5') if n.endswith('.npz'))
  assert shards == ['samples_0_00000.npz', 'samples_1_00001.npz', 'samples_1_00002.npz']
  images = []
  for name in shards:
    with np.load(outs[2] / 'cfg_1.5' / name) as two, np.load(outs[1] / 'cfg_1.5' / f'samples_0_{name[-9:]}') as one:
      np.testing.assert_array_equal(two['arr_0'], one['arr_0'])
      np.testing.assert_array_equal(two['arr_1'], one['arr_1'])
      images.append(one['arr_0'])
  scores = builtin.evaluate(np.concatenate(images) / np.float32(255), np.repeat(np.arange(10), 2))
  row = json.loads((outs[2] / 'results.json').read_text())['cfg_1.5']
  assert row['images'] == 20 and row['class_accuracy'] == scores['class_accuracy']
  np.testing.assert_allclose(row['frechet_distance'], scores['frechet_distance'], rtol=1e-6)


def test_processes_with_different_configs_stop_naming_the_key(tmp_path):
  job = _job(tmp_path, ECAR, per_process=[[f'--workdir={tmp_path}'],
                                         [f'--workdir={tmp_path}', '--config.train.lr=0.01']])
  assert job.wait(timeout=300) != [0, 0]
  assert 'processes [1] run another config than process 0' in job.err(0)
  assert 'here config.train.lr=0.01, on process 0 0.002' in job.err(1)


def test_a_workdir_that_is_not_shared_stops_every_process(tmp_path):
  workdirs = [tmp_path / 'a', tmp_path / 'b']
  job = _job(tmp_path, ECAR, per_process=[[f'--workdir={w}'] for w in workdirs])
  assert job.wait(timeout=300) != [0, 0]
  for i, workdir in enumerate(workdirs):
    assert f'--workdir={workdir} is not shared: processes [1] do not see the file process 0 wrote' in job.err(i)


DIFFERENT_PROGRAMS = r'''
import jax
from train import multihost
multihost.initialize()
multihost.check_same_program('train step', 'module\n  add\n' + ('  mul\n' if jax.process_index() else '  sub\n'))
'''


def test_processes_that_lower_different_programs_stop_naming_the_first_difference(tmp_path):
  job = _job(tmp_path, [], per_process=[[], []], run=('-c', DIFFERENT_PROGRAMS))
  assert job.wait(timeout=120) == [1, 1]
  assert 'processes [1] lowered another train step than process 0 (their logs name' in job.err(0)
  assert ("processes [1] lowered another train step than process 0; first difference at line 3: here 'mul', "
          "on process 0 'sub'") in job.err(1)


CUSTOM_PARTITIONED = r'''
import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P
from train import multihost
multihost.initialize()

@custom_partitioning
def double(x):
  return 2 * x
double.def_partition(
    partition=lambda mesh, args, result: (mesh, lambda x: 2 * x, args[0].sharding, args[0].sharding),
    infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding, sharding_rule='i -> i')
x = jax.ShapeDtypeStruct((8,), 'float32', sharding=NamedSharding(jax.make_mesh((2,), ('data',)), P('data')))
lowered = []
for _ in range(2 + jax.process_index()):   # each kept alive, so each gets a key of its own
  lowered.append(jax.jit(double).lower(x))
  jax.clear_caches()
texts = [lowered[-2].as_text(), lowered[-1].as_text()]
assert texts[0] != texts[1] and multihost.comparable_program(texts[0]) == multihost.comparable_program(texts[1])
multihost.check_same_program('train step', texts[1])
'''


def test_processes_agree_on_a_program_whose_custom_partitioned_ops_carry_per_process_callback_keys(tmp_path):
  job = _job(tmp_path, [], per_process=[[], []], run=('-c', CUSTOM_PARTITIONED))
  assert job.wait(timeout=120) == [0, 0], [job.err(i)[-2000:] for i in range(2)]


def test_a_start_up_phase_past_its_limit_ends_both_processes_naming_it(tmp_path):
  """Three processes declared, two started: both wait in distributed init for the third until their limit."""
  def three_declared(port, i, n):
    return launch.coordinator_env(port, i, n + 1)
  job = _job(tmp_path, [*ECAR, '--startup_timeout=1'], launch_env=three_declared)
  assert job.wait(timeout=120) == [75, 75], [job.err(i)[-2000:] for i in range(2)]
  for i in range(2):
    assert f'process {i} of 3: start-up phase "distributed init" did not end within --startup_timeout=1 s' in job.err(i)
