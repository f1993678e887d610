"""Many hosts: starting JAX's distributed runtime, and checking that the hosts run one job.

Every host runs the same command with the same --workdir on a shared file system:
  - SLURM, one task per host (it drives all of the host's GPUs and runs one data pipeline):
      srun --nodes=N --ntasks-per-node=1 python -m train --config ... --workdir /shared/run
    or one task per GPU (--ntasks-per-node=8, every GPU visible to every task: task k takes
    GPU k). JAX reads the job from SLURM_JOB_ID, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID and
    SLURM_STEP_NODELIST (srun sets them; the coordinator is the step's first node, on port
    61440 + SLURM_JOB_ID % 4096 unless JAX_COORDINATOR_PORT is set).
  - Anywhere else, on host i of N (host0 reachable from all):
      JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i python -m train ...
  - Neither: a single process with its local devices.

Failures. SIGTERM to any host (a scheduler's preemption notice) reaches JAX's preemption
service: every host saves the same step and stops (`train.trainer.Preemption`). A host that
dies stops sending heartbeats: after --heartbeat_timeout seconds the coordinator declares it dead
and every other host aborts with "the JAX distributed service detected fatal errors" instead of
waiting forever in a collective; the same command resumes from the last checkpoint.

Waiting. A device collective gives its peers a short time to arrive (gloo's context on the CPU:
30 s), so hosts that reach one far apart (one compiled or sampled longer) meet first at
`barrier`, the coordination service's, which waits as long as the work may take.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re

import jax
import numpy as np
from absl import flags

HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    'heartbeat_timeout', 100, 'multi-host runs: seconds after which a silent host is declared dead and the '
    'others abort (JAX distributed heartbeat timeout)')
SLURM_KEYS = ('SLURM_JOB_ID', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID', 'SLURM_STEP_NODELIST')


def initialize(heartbeat_timeout_s: int = 100) -> None:
  """Starts JAX's distributed runtime when the environment describes a multi-process job."""
  env = os.environ
  if env.get('JAX_COORDINATOR_ADDRESS'):
    for key in ('JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'):
      if not env.get(key, '').isdigit():
        raise ValueError(f'JAX_COORDINATOR_ADDRESS is set, so {key} must be set to an integer, '
                         f'got {env.get(key)!r}')
    jax.distributed.initialize(coordinator_address=env['JAX_COORDINATOR_ADDRESS'],
                               num_processes=int(env['JAX_NUM_PROCESSES']),
                               process_id=int(env['JAX_PROCESS_ID']),
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
  elif env.get('SLURM_JOB_ID') and int(env.get('SLURM_NTASKS', '1')) > 1:
    missing = [k for k in SLURM_KEYS if not env.get(k)]
    if missing:
      raise ValueError(f'a SLURM job of {env["SLURM_NTASKS"]} tasks, but {", ".join(missing)} not set: '
                       'start every task with srun (sbatch alone runs the script once)')
    # JAX's SLURM detection runs one process per GPU: it shows this one only GPU SLURM_LOCALID. With
    # one task per node the process drives all of the node's GPUs, which an empty device list keeps.
    nodes = int(env.get('SLURM_STEP_NUM_NODES') or env.get('SLURM_NNODES') or 0)
    whole_node = {'local_device_ids': []} if int(env['SLURM_NTASKS']) == nodes else {}
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s, **whole_node)


def process_name(started: bool) -> str:
  """'process i of n' for log lines: from the launcher's variables before the runtime has
  `started` (JAX's devices untouched), from JAX after."""
  if started:
    return f'process {jax.process_index()} of {jax.process_count()}'
  env = os.environ
  if env.get('JAX_COORDINATOR_ADDRESS'):
    return f'process {env.get("JAX_PROCESS_ID")} of {env.get("JAX_NUM_PROCESSES")}'
  if env.get('SLURM_JOB_ID') and int(env.get('SLURM_NTASKS', '1')) > 1:
    return f'process {env.get("SLURM_PROCID")} of {env["SLURM_NTASKS"]}'
  return 'process 0 of 1'


def _flat(tree, prefix: str = '') -> dict:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, f'{prefix}.{k}' if prefix else k))
  return out


def _allgather(x: np.ndarray) -> np.ndarray:
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x))


def _broadcast_text(text: str) -> str:
  """Process 0's `text` on every process."""
  from jax.experimental import multihost_utils
  data = np.frombuffer(text.encode(), np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
  padded = np.zeros(size, np.uint8)
  padded[:min(size, data.size)] = data[:size]
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(padded))).decode()


_BARRIERS = itertools.count()


def barrier(name: str, timeout_s: float = 24 * 3600) -> None:
  """Returns once every process has called it (the coordination service's barrier, not a device
  collective). A peer that died meanwhile is declared dead by its heartbeats and the others abort."""
  if jax.process_count() == 1:
    return
  from jax._src import distributed   # the runtime's client: its barrier has no public entry point
  distributed.global_state.client.wait_at_barrier(f'{name} #{next(_BARRIERS)}', int(timeout_s * 1000))


def check_same_config(config) -> None:
  """Raises on every host when any host's config differs from host 0's, naming the keys."""
  if jax.process_count() == 1:
    return
  text = config.to_json_best_effort(sort_keys=True)
  digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
  digests = _allgather(digest)
  differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
  if not differ:
    return
  ours, host0 = _flat(json.loads(text)), _flat(json.loads(_broadcast_text(text)))
  keys = sorted(k for k in ours.keys() | host0.keys() if ours.get(k) != host0.get(k))
  detail = ''.join(f'; here config.{k}={ours.get(k)!r}, on process 0 {host0.get(k)!r}' for k in keys[:5])
  raise ValueError(f'processes {differ} run another config than process 0{detail}: start every host with '
                   'the same command')


# A custom-partitioned op (cuDNN attention under a mesh, for one) lowers to a custom call whose
# backend_config is a key into the lowering process's table of partitioning callbacks: the same
# program carries another key on every host, and the key never reaches the compiled program.
_CALLBACK_KEY = re.compile(r'(@CustomSPMDPartitioning\(.*backend_config = )"\d+"')


def comparable_program(text: str) -> str:
  """`text` (StableHLO) with every per-process partitioning-callback key replaced by one name."""
  return _CALLBACK_KEY.sub(r'\1"<callback>"', text)


def check_same_program(name: str, text: str) -> None:
  """Raises on every host when any host lowered `text` (a program's StableHLO) other than host 0,
  naming the first line that differs; partitioning-callback keys are not compared."""
  if jax.process_count() == 1:
    return
  text = comparable_program(text)
  digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
  digests = _allgather(digest)
  differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
  if not differ:
    return
  ours, host0 = text.splitlines(), _broadcast_text(text).splitlines()
  if ours == host0:   # process 0, or a process that lowered what process 0 did
    detail = ' (their logs name the first line that differs)'
  else:
    line = next((i for i, (a, b) in enumerate(zip(ours, host0)) if a != b), min(len(ours), len(host0)))
    here = ours[line].strip() if line < len(ours) else '<end>'
    there = host0[line].strip() if line < len(host0) else '<end>'
    detail = f'; first difference at line {line + 1}: here {here[:300]!r}, on process 0 {there[:300]!r}'
  raise RuntimeError(f'processes {differ} lowered another {name} than process 0{detail}. Something the program '
                     'depends on differs between hosts (code, versions, config or input shapes), and hosts '
                     'running different programs would wait for each other forever')


def check_shared_workdir(workdir: str) -> None:
  """Raises on every host unless all see a file process 0 writes into `workdir`."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils
  os.makedirs(workdir, exist_ok=True)
  nonce = int(multihost_utils.broadcast_one_to_all(np.int32(np.random.default_rng().integers(2 ** 31))))
  probe = os.path.join(workdir, f'.shared-{nonce}')
  if jax.process_index() == 0:
    with open(probe, 'w') as f:
      f.write(str(nonce))
  barrier('workdir probe written')
  sees = _allgather(np.int32(os.path.exists(probe)))
  barrier('workdir probe read')
  if jax.process_index() == 0:
    os.remove(probe)
  blind = [p for p in range(len(sees)) if not sees[p]]
  if blind:
    raise ValueError(f'--workdir={workdir} is not shared: processes {blind} do not see the file process 0 wrote '
                     'there. Every host needs the same --workdir on a shared file system (all hosts write '
                     'each checkpoint together)')
