"""Deterministic per-host batches on grain: which examples a step reads, decoded in worker processes.

Example stream: epoch e is a permutation of [0, N) seeded by (seed, e); step s reads
stream positions [s B, (s + 1) B) (B = global batch), so the position to save is
the step alone. Host p of P takes rows [p B / P, (p + 1) B / P) of each global
batch; `train.mesh.global_batch` puts the hosts' rows back together as one array.
Example `index` of epoch e is augmented with a generator seeded by (seed, e, index):
a step's global batch is the same on any number of hosts and workers.

The grain pipeline (`Loader.dataset`): a MapDataset whose element s is this host's
rows of step s (each example decoded and augmented, then stacked), made by
`threads` threads in each of `workers` worker processes (0: in the training
process), each thread a whole batch. Element s is the same whichever worker makes
it, so the output is too; each row carries its stream 'position', which the trainer
checks against its step. The iterator's state (grain's) goes into every checkpoint
(`train.checkpoints`).
"""
from __future__ import annotations

import functools
import os
import signal
import threading
import time
from typing import Callable

import grain
import numpy as np
from absl import flags

# example(index, rng) -> {name: array}; rng is seeded by (seed, epoch, index).
ExampleFn = Callable[[int, np.random.Generator], dict]


def _exit_with_parent(parent: int) -> None:
  while os.getppid() == parent:
    time.sleep(1.0)
  os._exit(1)


def _init_worker(worker_index: int, worker_count: int) -> None:
  """A scheduler's SIGTERM reaches the workers too: they ignore it, since the training process saves,
  then stops them. A training process killed alone (SIGKILL, the OOM killer) cannot stop them, and
  grain's workers would live on, holding their memory and shared-memory batches: each exits within
  a second of its parent (the multiprocessing resource tracker then frees their batches)."""
  del worker_index, worker_count
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _grain_flags_parsed() -> None:
  """Grain reads its absl flags; outside `app.run` (tests, notebooks) they take their defaults."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


class HostStream:
  """This host's rows of every step, in order: item j (step j // b, row j % b) -> (position, epoch, index).

  A grain random-access source (len and getitem); picklable, so worker processes get their copy.
  """

  def __init__(self, num_examples: int, global_batch: int, seed: int, process_index: int, process_count: int,
               steps: int):
    self.num_examples, self.global_batch, self.seed, self.steps = num_examples, global_batch, seed, steps
    self.local_batch, self.process_index = global_batch // process_count, process_index

  def __len__(self) -> int:
    return self.steps * self.local_batch

  def __repr__(self) -> str:
    return (f'HostStream(num_examples={self.num_examples}, global_batch={self.global_batch}, seed={self.seed}, '
            f'process_index={self.process_index}, local_batch={self.local_batch})')

  @functools.lru_cache(maxsize=2)
  def order(self, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s permutation of the dataset: [N] int64."""
    return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

  def position(self, j: int) -> int:
    step, row = divmod(j, self.local_batch)
    return step * self.global_batch + self.process_index * self.local_batch + row

  def __getitem__(self, j: int) -> tuple[int, int, int]:
    position = self.position(int(j))
    epoch, within = divmod(position, self.num_examples)
    return position, epoch, int(self.order(epoch)[within])


class MakeExample:
  """(position, epoch, index) -> the example with its generator seeded by (seed, epoch, index), and its position."""

  def __init__(self, example: ExampleFn, seed: int):
    self.example, self.seed = example, seed

  def __call__(self, item: tuple[int, int, int]) -> dict:
    position, epoch, index = item
    out = dict(self.example(index, np.random.default_rng([self.seed, epoch, index])))
    out['position'] = np.int64(position)
    return out


class Loader:

  def __init__(self, example: ExampleFn, num_examples: int, *, global_batch: int, seed: int, steps: int,
               process_index: int = 0, process_count: int = 1, workers: int = 0, threads: int = 8):
    if global_batch % process_count:
      raise ValueError(f'config.train.batch_size={global_batch} must divide over {process_count} hosts')
    if num_examples < 1:
      raise ValueError('the dataset is empty')
    self.example, self.num_examples, self.seed, self.steps = example, num_examples, seed, steps
    self.global_batch, self.local_batch_size = global_batch, global_batch // process_count
    self.process_index, self.process_count = process_index, process_count
    self.workers, self.threads = workers, max(1, threads)

  @property
  def stream(self) -> HostStream:
    return HostStream(self.num_examples, self.global_batch, self.seed, self.process_index, self.process_count,
                      self.steps)

  def local_positions(self, step: int) -> np.ndarray:
    """Stream positions of this host's rows of step `step`'s batch: [b] int64."""
    start = step * self.global_batch + self.process_index * self.local_batch_size
    return np.arange(start, start + self.local_batch_size, dtype=np.int64)

  def local_indices(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(epochs [b], dataset indices [b]) of this host's rows of step `step`."""
    b = self.local_batch_size
    items = [self.stream[j] for j in range(step * b, (step + 1) * b)]
    return np.array([e for _, e, _ in items], np.int64), np.array([i for _, _, i in items], np.int64)

  def dataset(self, start: int = 0) -> grain.MapDataset:
    """Element k: this host's rows of step start + k, {name: [b, ...], 'position': [b] int64}."""
    b = self.local_batch_size
    examples = grain.MapDataset.source(self.stream)[start * b:].map(MakeExample(self.example, self.seed))
    return examples.batch(b, drop_remainder=True)

  def batch(self, step: int) -> dict:
    """This host's rows of step `step`, made in this thread: {name: [b, ...]} without 'position'."""
    out = dict(self.dataset(step)[0])
    del out['position']
    return out

  def iterator(self, start: int = 0) -> grain.DatasetIterator:
    """Batches of steps start, start + 1, ...: `threads` batches made ahead at a time in each of
    `workers` processes (in this process when 0).

    The iterator's state counts from `start`: a checkpointed state is restored into an iterator
    built with the same `start` and worker count (`train.trainer` records both).
    """
    _grain_flags_parsed()
    reading = grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=self.threads)
    ds = self.dataset(start).to_iter_dataset(reading)
    if self.workers:
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers), worker_init_fn=_init_worker)
    return iter(ds)
