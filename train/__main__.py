"""Train a model: `python -m train --config configs/ecar.py:tiny --workdir runs/demo [--config.KEY=VALUE ...]`.

Families: configs/var.py (VAR; its frozen VQVAE from config.vqvae_ckpt; the
variants vqvae and vqvae_tiny train that VQVAE), configs/mar.py (MAR; its
frozen KL VAE from config.vae_ckpt), configs/ecar.py.
The same command resumes: a --workdir holding checkpoints continues from the
latest one (parameters, optimizer, EMA, model state, RNG and data position).
SIGTERM saves a checkpoint and stops. On many hosts, run the same command on
every host; see train/multihost.py for the SLURM and coordinator-address set-ups.
"""
from __future__ import annotations

import logging as pylogging

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from sampling import compilation_cache
from train import multihost, throughput
from train.startup import Startup

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/{ecar,var,mar}.py:VARIANT', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'where checkpoints, logs and samples go (resumed if present)')
_STARTUP_TIMEOUT = flags.DEFINE_float(
    'startup_timeout', 1800, 'seconds any one start-up phase (distributed init, checks, data, state, compile, '
    'first step) may take before the process stops with an error naming the phase; 0: no limit')


class _QuietOrbax(pylogging.Filter):
  """Orbax logs every save step at INFO; keep its warnings only."""

  def filter(self, record):
    return record.levelno >= pylogging.WARNING or 'orbax' not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.get_absl_handler().addFilter(_QuietOrbax())
  compilation_cache.enable(compilation_cache.COMPILATION_CACHE.value)
  startup = Startup(_STARTUP_TIMEOUT.value, multihost.process_name(started=False))
  with startup.phase('distributed init'):
    multihost.initialize(multihost.HEARTBEAT_TIMEOUT.value)
    startup.process = multihost.process_name(started=True)
  from train.trainer import Trainer  # after the distributed runtime starts: it touches devices
  try:
    result = Trainer(_CONFIG.value, _WORKDIR.value, startup=startup).run()
  except jax.errors.JaxRuntimeError as e:
    if jax.process_count() == 1:
      raise
    # A peer that died breaks the collective in flight here; JAX then aborts this process once the
    # peer's heartbeats have been missing for --heartbeat_timeout seconds.
    raise RuntimeError(f'process {jax.process_index()} of {jax.process_count()}: {str(e).splitlines()[0]}. '
                       'Another process has probably died (see its log); this one stops too. The same '
                       f'command resumes from the last checkpoint in {_WORKDIR.value}') from e
  if result.preempted:
    print(f'stopped at step {int(result.state.step)} on SIGTERM; the same command resumes')
  else:
    print(f'done: {_WORKDIR.value} holds the checkpoints, samples/ and the exported EMA params')
  memory = throughput.peak_memory_gib()
  if memory is not None:
    print(f'process {jax.process_index()}: peak device memory {memory:.2f} GiB')
  scores = result.sample_scores
  if scores:
    print(f"samples at step {scores['step']}, scored by the built-in data's classifier: class accuracy "
          f"{scores['class_accuracy']:.1%}, Frechet distance {scores['frechet_distance']:.1f}")


if __name__ == '__main__':
  flags.mark_flags_as_required(['config', 'workdir'])
  app.run(main)
