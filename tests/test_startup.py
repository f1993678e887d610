"""Start-up phases: logged with their durations, and a phase past --startup_timeout ends the process
with an error naming the phase and the process."""
import subprocess
import sys
import time

import pytest

from train import launch
from train.startup import EXIT_CODE, Startup


def test_a_phase_past_its_limit_reports_the_phase_and_the_process():
  messages = []
  startup = Startup(0.2, 'process 1 of 2', on_timeout=messages.append)
  with startup.phase('compile the train step'):
    time.sleep(0.6)
  assert len(messages) == 1
  assert 'process 1 of 2' in messages[0] and '"compile the train step"' in messages[0]
  assert '--startup_timeout=0.2' in messages[0]
  assert startup.durations['compile the train step'] >= 0.6


def test_phases_that_end_in_time_are_timed_and_never_reported():
  messages = []
  startup = Startup(5, on_timeout=messages.append)
  for name in ('distributed init', 'data pipeline'):
    with startup.phase(name):
      pass
  time.sleep(0.1)
  assert messages == [] and sorted(startup.durations) == ['data pipeline', 'distributed init']


def test_a_zero_limit_never_reports():
  messages = []
  startup = Startup(0, on_timeout=messages.append)
  with startup.phase('first step'):
    time.sleep(0.2)
  assert messages == []


def test_train_logs_every_phase_and_exits_naming_the_one_past_its_limit(tmp_path):
  """A limit no start-up meets: the process ends with the error and its Python stacks, nothing hangs."""
  proc = subprocess.run([sys.executable, '-m', 'train', '--config=configs/ecar.py:tiny', f'--workdir={tmp_path}',
                         '--config.train.sample_classes=0', '--config.data.workers=0', '--startup_timeout=0.05'],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == EXIT_CODE
  assert 'process 0 of 1: start-up phase "' in proc.stderr and 'did not end within --startup_timeout=0.05 s' in proc.stderr
  assert 'Current thread' in proc.stderr or 'Thread 0x' in proc.stderr   # the stacks


def test_train_logs_the_duration_of_each_start_up_phase(tmp_path):
  # One AR and one denoiser block per stage: the phases do not depend on depth, the compile does.
  proc = subprocess.run([sys.executable, '-m', 'train', '--config=configs/ecar.py:tiny', f'--workdir={tmp_path}',
                         '--config.model.ar_depth=1', '--config.model.den_depth=1', '--config.train.steps=1',
                         '--config.train.sample_classes=0', '--config.data.workers=0'],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for phase in ('distributed init', 'config and workdir checks', 'model and frozen tokenizer', 'data pipeline',
                'train state (init or restore)', 'data pipeline: first batch', 'compile the train step',
                'every process compiled', 'first step'):
    assert f'[process 0 of 1] start-up: {phase}: ' in proc.stderr, phase


def test_a_job_killed_at_its_timeout_names_the_start_up_phase_each_process_was_in(tmp_path):
  stuck = ("import sys, time; log = lambda s: print('I0 startup.py:1] [process 0 of 1] start-up: ' + s, "
           "file=sys.stderr, flush=True); log('data pipeline ...'); log('data pipeline: 0.1 s'); "
           "log('compile the train step ...'); time.sleep(60)")
  job = launch.Job(tmp_path / 'logs', [['-c', stuck]], [{}], launch=None)
  with pytest.raises(RuntimeError, match='process 0 exited with -9 after 3 s in start-up phase "compile the train step"'):
    job.succeed(timeout=3)
