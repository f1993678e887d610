"""The mesh and shardings: parameter specs, multi-host start-up, runs on 2 hosts and on 8 devices.

Both multi-device runs are subprocesses: two processes joined by jax.distributed
(the coordinator-address set-up), and one process with 8 simulated devices
(XLA_FLAGS must be set before JAX starts) on a data=4 x fsdp=2 mesh. Each must
match the same run on this process's one device.
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from test_train_loop import toy_config, toy_family  # noqa: F401  (the fixture registers the toy family)
from train import mesh as mesh_lib
from train.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, 'tests')
WIDE = 8192  # toy hidden width: its arrays are large enough to be split over fsdp

EIGHT_DEVICES = r'''
import json, sys
import jax, numpy as np
sys.path.insert(0, {tests!r})
from test_train_loop import _toy_task, toy_config
from train import mesh as mesh_lib, tasks
from train.trainer import Trainer

tasks.BUILDERS['toy'] = _toy_task
assert jax.device_count() == 8
config = toy_config(mesh_data=4, mesh_fsdp=2, batch_size=8, sample_classes=0)
config.model.width = {wide}
trainer = Trainer(config, {workdir!r})
batch = trainer.loader.batch(0)
glob = mesh_lib.global_batch(trainer.mesh, batch)['image']
rows = sorted((s.index[0].start, s.index[0].stop, int(np.array_equal(np.asarray(s.data), batch['image'][s.index[0]])))
              for s in glob.addressable_shards)
result = trainer.run()
state = result.state
np.savez({out!r}, hidden=np.asarray(state.params['hidden']), out=np.asarray(state.params['out']),
         ema=np.asarray(state.ema_params['out']), loss=result.last_metrics['loss'])
print(json.dumps(dict(rows=rows, hidden=str(state.params['hidden'].sharding.spec),
                      out=str(state.params['out'].sharding.spec), mu=str(state.opt_state[0].mu['out'].sharding.spec),
                      mesh=dict(trainer.mesh.shape))))
'''


TWO_HOSTS = r'''
import json, sys
sys.path.insert(0, {tests!r})
import jax, numpy as np
from train import mesh as mesh_lib
mesh_lib.initialize_distributed()   # from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
from test_train_loop import _toy_task, toy_config
from train import tasks
from train.trainer import Trainer

tasks.BUILDERS['toy'] = _toy_task
config = toy_config(batch_size=8, sample_classes=2)
config.model.width = {wide}
trainer = Trainer(config, {workdir!r})
result = trainer.run()
print(json.dumps(dict(process=jax.process_index(), processes=jax.process_count(), devices=jax.device_count(),
                      rows=trainer.loader.local_positions(0).tolist(), loss=float(result.last_metrics['loss']),
                      out=mesh_lib.to_host(result.state.params['out']).tolist())))
'''


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def test_param_spec_splits_the_largest_divisible_dimension_over_fsdp():
  assert mesh_lib.param_spec((4096, 1024), 2) == P('fsdp', None)
  assert mesh_lib.param_spec((3, 8192), 2) == P(None, 'fsdp')
  assert mesh_lib.param_spec((1023, 4097), 2) == P()           # nothing divides
  assert mesh_lib.param_spec((16, 16), 2) == P()               # too small to bother
  assert mesh_lib.param_spec((4096, 1024), 1) == P()           # plain data parallelism


def test_mesh_shape_resolves_minus_one_and_names_the_keys():
  assert mesh_lib.mesh_shape(-1, 2, 8) == (4, 2)
  with pytest.raises(ValueError, match='config.train.mesh_fsdp=3'):
    mesh_lib.mesh_shape(-1, 3, 8)
  with pytest.raises(ValueError, match='config.train.mesh_data=2 x mesh_fsdp=2'):
    mesh_lib.mesh_shape(2, 2, 8)


def test_multi_host_start_needs_every_coordinator_variable(monkeypatch):
  monkeypatch.setenv('JAX_COORDINATOR_ADDRESS', 'host0:1234')
  monkeypatch.setenv('JAX_NUM_PROCESSES', '2')
  monkeypatch.delenv('JAX_PROCESS_ID', raising=False)
  with pytest.raises(ValueError, match='JAX_PROCESS_ID must be set'):
    mesh_lib.initialize_distributed()


def test_a_single_process_starts_without_the_distributed_runtime(monkeypatch):
  for key in ('JAX_COORDINATOR_ADDRESS', 'SLURM_JOB_ID'):
    monkeypatch.delenv(key, raising=False)
  mesh_lib.initialize_distributed()  # a no-op: nothing to connect to


def test_two_processes_through_jax_distributed_match_one(tmp_path):
  """Two hosts (processes of one CPU device each) started by the coordinator-address variables:
  each reads its half of every batch, and they train, checkpoint and sample as one run does."""
  script = TWO_HOSTS.format(tests=TESTS, wide=WIDE, workdir=str(tmp_path / 'two'))
  port = _free_port()
  procs, logs = [], [(tmp_path / f'out{i}', tmp_path / f'err{i}') for i in range(2)]
  for i, (out, err) in enumerate(logs):
    env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_COORDINATOR_ADDRESS=f'localhost:{port}',
               JAX_NUM_PROCESSES='2', JAX_PROCESS_ID=str(i),
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get('PYTHONPATH', '')]))
    env.pop('XLA_FLAGS', None)
    # Files, not pipes: a host blocked on a full pipe would stall the other in a collective.
    with open(out, 'w') as fo, open(err, 'w') as fe:
      procs.append(subprocess.Popen([sys.executable, '-c', script], env=env, stdout=fo, stderr=fe))
  try:
    for p in procs:
      p.wait(timeout=240)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (_, err) in zip(procs, logs):
    assert p.returncode == 0, err.read_text()[-3000:]
  reports = [json.loads(out.read_text().strip().splitlines()[-1]) for out, _ in logs]
  assert [(r['process'], r['processes'], r['devices']) for r in reports] == [(0, 2, 2), (1, 2, 2)]
  assert reports[0]['rows'] == [0, 1, 2, 3] and reports[1]['rows'] == [4, 5, 6, 7]
  assert sorted(os.listdir(tmp_path / 'two' / 'checkpoints')) == ['2', '4', '6']
  assert os.path.exists(tmp_path / 'two' / 'samples' / 'step_0000006.png')

  config = toy_config(batch_size=8, sample_classes=0)
  config.model.width = WIDE
  one = Trainer(config, str(tmp_path / 'one')).run()
  for r in reports:
    np.testing.assert_allclose(r['loss'], one.last_metrics['loss'], rtol=1e-5)
    np.testing.assert_allclose(r['out'], np.asarray(one.state.params['out']), rtol=1e-4, atol=1e-5)


def test_eight_devices_with_fsdp_match_one_device(tmp_path):
  out = str(tmp_path / 'eight.npz')
  script = EIGHT_DEVICES.format(tests=TESTS, wide=WIDE, workdir=str(tmp_path / 'eight'), out=out)
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8', JAX_PLATFORMS='cpu',
             PYTHONPATH=os.pathsep.join([REPO, os.environ.get('PYTHONPATH', '')]))
  proc = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  assert report['mesh'] == {'data': 4, 'fsdp': 2}
  # Each device holds its own row of the 8-row batch, with the host's data.
  assert report['rows'] == [[i, i + 1, 1] for i in range(8)]
  assert report['hidden'] == str(P(None, 'fsdp')) and report['out'] == str(P('fsdp', None))
  assert report['mu'] == str(P('fsdp', None))  # the optimizer state is split like its parameter

  config = toy_config(batch_size=8, sample_classes=0)
  config.model.width = WIDE
  one = Trainer(config, str(tmp_path / 'one')).run()
  eight = np.load(out)
  np.testing.assert_allclose(eight['loss'], one.last_metrics['loss'], rtol=1e-5)
  np.testing.assert_allclose(eight['hidden'], np.asarray(one.state.params['hidden']), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(eight['out'], np.asarray(one.state.params['out']), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(eight['ema'], np.asarray(one.state.ema_params['out']), rtol=1e-4, atol=1e-5)
