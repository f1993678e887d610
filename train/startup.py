"""Start-up phases of `python -m train`, each logged with its duration and bounded in time.

A run's start is a chain of phases (distributed init, config and workdir checks, data pipeline,
state, compile, first step) that on many hosts wait for each other. A phase that never ends
(a peer that never arrives, a compiler that never returns) would leave every host silent.
`Startup.phase(name)` logs the phase's start and end; a phase that outlasts `timeout_s` makes a
watchdog thread print the process's Python stacks and end the process with an error naming the
phase and the process. Each host runs the same phases, so each hits its own limit; a host stuck
elsewhere loses its peer's heartbeats and aborts as it does for a dead peer (train/multihost.py).
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import Callable, Optional

from absl import logging

EXIT_CODE = 75   # EX_TEMPFAIL: the same command may succeed once the stuck peer or resource is back


def _abort(message: str) -> None:
  """Ends the process from the watchdog thread: the main thread may be blocked in C++."""
  logging.error('%s', message)
  print(message, file=sys.stderr, flush=True)
  faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
  sys.stderr.flush()
  os._exit(EXIT_CODE)


class Startup:
  """`with startup.phase('compile the train step'):` logs '[process p of n] start-up: NAME ...' and
  '... NAME: S s'. `process` names this process in every line (set once the runtime is up).

  timeout_s <= 0 turns the limit off. `on_timeout(message)` ends the process (tests replace it).
  """

  def __init__(self, timeout_s: float, process: str = 'process 0 of 1',
               on_timeout: Callable[[str], None] = _abort):
    self.timeout_s, self.process, self._on_timeout = timeout_s, process, on_timeout
    self.durations: dict[str, float] = {}

  @contextlib.contextmanager
  def phase(self, name: str):
    who = self.process
    logging.info('[%s] start-up: %s ...', who, name)
    t0 = time.perf_counter()
    done = threading.Event()
    watchdog: Optional[threading.Thread] = None
    if self.timeout_s > 0:
      def watch():
        if not done.wait(self.timeout_s):
          self._on_timeout(f'{who}: start-up phase "{name}" did not end within --startup_timeout='
                           f'{self.timeout_s:g} s; this process stops (its Python stacks follow). If another '
                           'process is stuck or dead, its log says where')
      watchdog = threading.Thread(target=watch, name=f'startup watchdog: {name}', daemon=True)
      watchdog.start()
    try:
      yield
    finally:
      done.set()
      self.durations[name] = time.perf_counter() - t0
      logging.info('[%s] start-up: %s: %.1f s', who, name, self.durations[name])


def unbounded() -> Startup:
  """Phases logged, never timed out (library use: tests, notebooks)."""
  return Startup(0)
