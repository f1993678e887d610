"""The mesh and shardings: parameter specs, device order over hosts, multi-host start-up, a run on 8 devices.

The 8-device run is a subprocess (XLA_FLAGS must be set before JAX starts) on a
data=4 x fsdp=2 mesh; it must match the same run on this process's one device.
Runs of several processes are in test_multihost.py.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import JOB_XLA_FLAGS, TEST_XLA_FLAGS
from test_train_loop import toy_config, toy_family  # noqa: F401  (the fixture registers the toy family)
from train import mesh as mesh_lib, multihost
from train.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, 'tests')
WIDE = 8192  # toy hidden width: its arrays are large enough to be split over fsdp

EIGHT_DEVICES = r'''
import json, sys
import jax, numpy as np
sys.path.insert(0, {tests!r})
from test_train_loop import _toy_task, toy_config
from train import mesh as mesh_lib, tasks, throughput
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
split = {{k: state.params[k] for k in ('hidden', 'out')}}
print(json.dumps(dict(rows=rows, hidden=str(state.params['hidden'].sharding.spec),
                      split_bytes=[throughput.bytes_on_device(split, jax.devices()[0]),
                                   sum(x.nbytes for x in split.values())],
                      out=str(state.params['out'].sharding.spec), mu=str(state.opt_state[0].mu['out'].sharding.spec),
                      mesh=dict(trainer.mesh.shape))))
'''

# MAR's and E-CAR's small configs on 2 devices (the families whose steps make rows of their own:
# DiffLoss's repeated rows, the flow's per-stage tokens): the train step's temporaries per device,
# compiled (not run) by the trainer for 2 x `per_device` rows, and for `per_device` rows on a mesh
# of one device.
STEP_TEMPORARIES = r'''
import json, sys
import jax
sys.path.insert(0, {tests!r})
from test_train_families import small_ecar, small_mar
from train import mesh as mesh_lib
from train.checkpoints import abstract_like
from train.state import abstract_state
from train.step import compile_train_step
from train.trainer import Trainer

def one_device(trainer, rows):
  mesh = mesh_lib.make_mesh(1, 1, jax.devices()[:1])
  abstract, shardings = abstract_state(trainer.task.init, trainer.tx, mesh, trainer.t.seed)
  frozen = mesh_lib.put(trainer.task.frozen, mesh_lib.state_shardings(mesh, trainer.task.frozen))
  return compile_train_step(trainer.task, trainer.tx, trainer.schedule, trainer.t, mesh, shardings,
                            abstract_like(abstract, shardings), frozen, mesh_lib.global_batch(mesh, rows))[0]

out = {{}}
for name, build in (('mar', small_mar), ('ecar', small_ecar)):
  config = build()
  config.model.update({{'diffusion_batch_mul': 4}} if name == 'mar' else {{}})
  config.train.batch_size = config.data.num_examples = 2 * {per_device}
  trainer = Trainer(config, f'{workdir}/{{name}}')
  batch = trainer.loader.batch(0)
  two, _ = trainer.compile_step(mesh_lib.global_batch(trainer.mesh, batch))
  one = one_device(trainer, {{k: v[:{per_device}] for k, v in batch.items()}})
  out[name] = [one.memory_analysis().temp_size_in_bytes, two.memory_analysis().temp_size_in_bytes]
print(json.dumps(out))
'''


def run_on_cpu_devices(script: str, devices: int, xla_flags: str = TEST_XLA_FLAGS) -> subprocess.Popen:
  env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={devices} {xla_flags}',
             JAX_PLATFORMS='cpu', PYTHONPATH=os.pathsep.join([REPO, os.environ.get('PYTHONPATH', '')]))
  return subprocess.Popen([sys.executable, '-c', script], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def last_json_line(proc: subprocess.Popen):
  stdout, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 0, stderr[-3000:]
  return json.loads(stdout.strip().splitlines()[-1])


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


class _Device:
  def __init__(self, process_index, id):
    self.process_index, self.id = process_index, id


def test_the_mesh_keeps_each_fsdp_group_on_one_host():
  hosts, per_host = 4, 8
  devices = [_Device(p, 100 * p + d) for d in range(per_host) for p in range(hosts)]   # interleaved
  for fsdp in (2, 8):
    grid = mesh_lib.device_grid(devices, -1, fsdp)
    assert grid.shape == (hosts * per_host // fsdp, fsdp)
    assert all(len({d.process_index for d in row}) == 1 for row in grid)
  spanning = mesh_lib.device_grid(devices, -1, 16)   # larger than a host: two hosts per group
  assert [sorted({d.process_index for d in row}) for row in spanning] == [[0, 1], [2, 3]]


def test_a_slurm_job_started_without_srun_names_the_missing_variables(monkeypatch):
  monkeypatch.delenv('JAX_COORDINATOR_ADDRESS', raising=False)
  for key, value in (('SLURM_JOB_ID', '7'), ('SLURM_NTASKS', '4'), ('SLURM_PROCID', '0')):
    monkeypatch.setenv(key, value)
  for key in ('SLURM_LOCALID', 'SLURM_STEP_NODELIST'):
    monkeypatch.delenv(key, raising=False)
  with pytest.raises(ValueError, match='SLURM_LOCALID, SLURM_STEP_NODELIST not set: start every task with srun'):
    multihost.initialize()


@pytest.mark.parametrize('tasks, nodes, devices', [('4', '4', []), ('8', '1', None)])
def test_a_slurm_task_per_node_keeps_every_gpu_of_its_node(monkeypatch, tasks, nodes, devices):
  """One task per node drives all of the node's GPUs (JAX alone would pin it to GPU SLURM_LOCALID);
  one task per GPU is left to JAX."""
  calls = []
  monkeypatch.setattr(multihost.jax.distributed, 'initialize', lambda **kw: calls.append(kw))
  monkeypatch.delenv('JAX_COORDINATOR_ADDRESS', raising=False)
  for key in multihost.SLURM_KEYS:
    monkeypatch.setenv(key, '0')
  monkeypatch.setenv('SLURM_NTASKS', tasks)
  monkeypatch.setenv('SLURM_STEP_NUM_NODES', nodes)
  multihost.initialize(7)
  assert calls[0].get('local_device_ids') == devices and calls[0]['heartbeat_timeout_seconds'] == 7


def test_multi_host_start_needs_every_coordinator_variable(monkeypatch):
  monkeypatch.setenv('JAX_COORDINATOR_ADDRESS', 'host0:1234')
  monkeypatch.setenv('JAX_NUM_PROCESSES', '2')
  monkeypatch.delenv('JAX_PROCESS_ID', raising=False)
  with pytest.raises(ValueError, match='JAX_PROCESS_ID must be set'):
    multihost.initialize()


def test_a_single_process_starts_without_the_distributed_runtime(monkeypatch):
  for key in ('JAX_COORDINATOR_ADDRESS', 'SLURM_JOB_ID'):
    monkeypatch.delenv(key, raising=False)
  multihost.initialize()  # a no-op: nothing to connect to


def test_eight_devices_with_fsdp_match_one_device(tmp_path):
  out = str(tmp_path / 'eight.npz')
  script = EIGHT_DEVICES.format(tests=TESTS, wide=WIDE, workdir=str(tmp_path / 'eight'), out=out)
  report = last_json_line(run_on_cpu_devices(script, 8))
  assert report['mesh'] == {'data': 4, 'fsdp': 2}
  # Each device holds its own row of the 8-row batch, with the host's data.
  assert report['rows'] == [[i, i + 1, 1] for i in range(8)]
  assert report['hidden'] == str(P(None, 'fsdp')) and report['out'] == str(P('fsdp', None))
  assert report['mu'] == str(P('fsdp', None))  # the optimizer state is split like its parameter
  on_one_device, whole = report['split_bytes']
  assert on_one_device * 2 == whole   # fsdp = 2: each device keeps half of a split parameter

  config = toy_config(batch_size=8, sample_classes=0)
  config.model.width = WIDE
  one = Trainer(config, str(tmp_path / 'one')).run()
  eight = np.load(out)
  np.testing.assert_allclose(eight['loss'], one.last_metrics['loss'], rtol=1e-5)
  np.testing.assert_allclose(eight['hidden'], np.asarray(one.state.params['hidden']), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(eight['out'], np.asarray(one.state.params['out']), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(eight['ema'], np.asarray(one.state.ema_params['out']), rtol=1e-4, atol=1e-5)


def test_a_data_parallel_step_needs_per_device_what_one_device_needs_for_its_rows(tmp_path):
  """Two devices at twice the batch hold each row's activations once: nothing of the step runs on
  the whole batch on every device (MAR's tiled DiffLoss rows once did: 1.28x the temporaries)."""
  script = STEP_TEMPORARIES.format(tests=TESTS, per_device=8, workdir=str(tmp_path))
  for family, (one, two) in last_json_line(run_on_cpu_devices(script, 2, JOB_XLA_FLAGS)).items():
    assert two <= 1.1 * one, (family, one, two)
