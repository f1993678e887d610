"""Several local processes of one command as one JAX job: the multi-host recipes on one machine.

`Job` starts process i of n with the variables a launcher sets (`coordinator_env`, or
`slurm_env` as `srun` would) plus its own (its devices: JAX_NUM_CPU_DEVICES,
CUDA_VISIBLE_DEVICES), each in its own session as a scheduler's job step is, with its
output in files (a process blocked on a full pipe would stall the others in a
collective). tests/test_multihost.py and benchmarks/multiprocess_gpu.py use it.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def coordinator_env(port: int, i: int, n: int) -> dict:
  return {'JAX_COORDINATOR_ADDRESS': f'127.0.0.1:{port}', 'JAX_NUM_PROCESSES': str(n), 'JAX_PROCESS_ID': str(i)}


def slurm_env(port: int, i: int, n: int) -> dict:
  """What `srun --ntasks=n` sets on one node (the port pinned so that jobs side by side do not meet)."""
  return {'SLURM_JOB_ID': '4242', 'SLURM_NTASKS': str(n), 'SLURM_PROCID': str(i), 'SLURM_LOCALID': str(i),
          'SLURM_STEP_NODELIST': 'localhost', 'SLURM_STEP_NUM_NODES': '1', 'JAX_COORDINATOR_PORT': str(port)}


class Job:
  """Processes `python *args[i]` (i < n), joined by `launch` when n > 1; logs in logs/out{i}, logs/err{i}."""

  def __init__(self, logs: str, args: Sequence[Sequence[str]], envs: Sequence[dict],
               launch: Optional[Callable[[int, int, int], dict]] = coordinator_env):
    self.logs, n = str(logs), len(args)
    os.makedirs(self.logs, exist_ok=True)
    port, self.procs = free_port(), []
    for i in range(n):
      env = {k: v for k, v in os.environ.items() if not k.startswith(('SLURM_', 'JAX_COORDINATOR', 'JAX_NUM_',
                                                                       'JAX_PROCESS_ID'))}
      env['PYTHONPATH'] = os.pathsep.join([REPO, os.environ.get('PYTHONPATH', '')])
      env.update(envs[i])
      if n > 1 and launch is not None:
        env.update(launch(port, i, n))
      with open(self._path('out', i), 'a') as out, open(self._path('err', i), 'a') as err:
        self.procs.append(subprocess.Popen([sys.executable, *args[i]], cwd=REPO, env=env, stdout=out, stderr=err,
                                           start_new_session=True))

  def __enter__(self) -> 'Job':
    return self

  def __exit__(self, *exc) -> None:
    self.kill()

  def kill(self) -> None:
    """SIGKILL to the session of every process still running (a leaving caller takes its job along)."""
    for p in self.procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

  def _path(self, kind: str, i: int) -> str:
    return os.path.join(self.logs, f'{kind}{i}')

  def err(self, i: int) -> str:
    with open(self._path('err', i)) as f:
      return f.read()

  def out(self, i: int) -> str:
    with open(self._path('out', i)) as f:
      return f.read()

  def phase(self, i: int) -> Optional[str]:
    """The start-up phase process i last began and has not ended (train/startup.py's log), if any."""
    current = None
    for line in self.err(i).splitlines():
      begun = re.search(r'start-up: (.+) \.\.\.$', line)
      if begun:
        current = begun.group(1)
      elif current and f'start-up: {current}: ' in line:
        current = None
    return current

  def signal(self, i: int, sig) -> None:
    """To process i's whole session (its data workers too), as a scheduler signals a job step."""
    os.killpg(self.procs[i].pid, sig)

  def wait_for_step(self, step: int, timeout: float = 600) -> None:
    """Until process 0's progress bar shows `step` steps taken."""
    deadline = time.monotonic() + timeout
    while f' {step}/' not in self.err(0):
      if any(p.poll() is not None for p in self.procs):
        raise RuntimeError(f'a process ended before step {step}:\n{self.err(0)[-3000:]}')
      if time.monotonic() > deadline:
        raise TimeoutError(f'no step {step} within {timeout} s')
      time.sleep(0.05)

  def wait(self, timeout: float = 600) -> list[int]:
    """Exit codes; a process still running after `timeout` seconds is killed (with its session)."""
    deadline = time.monotonic() + timeout
    try:
      for p in self.procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
    finally:
      self.kill()
    return [p.returncode for p in self.procs]

  def succeed(self, timeout: float = 600) -> None:
    stuck = {}
    deadline = time.monotonic() + timeout
    codes = self.wait(timeout)
    if time.monotonic() >= deadline:
      stuck = {i: self.phase(i) for i in range(len(self.procs))}
    for i, code in enumerate(codes):
      if code != 0:
        where = f' after {timeout:g} s in start-up phase "{stuck[i]}"' if stuck.get(i) else ''
        raise RuntimeError(f'process {i} exited with {code}{where}:\n{self.err(i)[-3000:]}')
