"""Deterministic batches: which examples a step reads, and this host's share of them.

Example stream: epoch e is a permutation of [0, N) seeded by (seed, e); step s reads
stream positions [s B, (s + 1) B) (B = global batch), so the position to save is
the step alone. Host p of P takes rows [p B / P, (p + 1) B / P) of each global
batch; `train.mesh.global_batch` puts the hosts' rows back together as one array.
A background thread prepares the next `prefetch` batches with `workers` threads.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional

import numpy as np

# example(index, rng) -> {name: array}; rng is seeded by (seed, epoch, index).
ExampleFn = Callable[[int, np.random.Generator], dict]


class Loader:

  def __init__(self, example: ExampleFn, num_examples: int, *, global_batch: int, seed: int,
               process_index: int = 0, process_count: int = 1, workers: int = 8, prefetch: int = 2):
    if global_batch % process_count:
      raise ValueError(f'config.train.batch_size={global_batch} must divide over {process_count} hosts')
    if num_examples < 1:
      raise ValueError('the dataset is empty')
    self.example, self.num_examples, self.seed = example, num_examples, seed
    self.global_batch, self.local_batch_size = global_batch, global_batch // process_count
    self.process_index = process_index
    self.workers, self.prefetch = max(1, workers), max(1, prefetch)
    self._orders: dict[int, np.ndarray] = {}

  def _order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)}
    return self._orders[epoch]

  def local_positions(self, step: int) -> np.ndarray:
    """Stream positions of this host's rows of step `step`'s batch: [b] int64."""
    start = step * self.global_batch + self.process_index * self.local_batch_size
    return np.arange(start, start + self.local_batch_size, dtype=np.int64)

  def local_indices(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(epochs [b], dataset indices [b]) of this host's rows of step `step`."""
    epochs, within = np.divmod(self.local_positions(step), self.num_examples)
    return epochs, np.array([self._order(int(e))[w] for e, w in zip(epochs, within)], np.int64)

  def _one(self, epoch: int, index: int) -> dict:
    return self.example(int(index), np.random.default_rng([self.seed, epoch, index]))

  def batch(self, step: int, pool: Optional[ThreadPoolExecutor] = None) -> dict:
    """This host's rows of step `step`: {name: [b, ...]}."""
    epochs, indices = self.local_indices(step)
    mapper = pool.map if pool is not None else map
    rows = list(mapper(self._one, epochs, indices))
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  def iterate(self, start_step: int) -> Iterator[dict]:
    """Batches of steps start_step, start_step + 1, ... prepared ahead in a background thread."""
    out: queue.Queue = queue.Queue(maxsize=self.prefetch)
    stop = threading.Event()

    def produce():
      with ThreadPoolExecutor(self.workers) as pool:
        step = start_step
        while not stop.is_set():
          try:
            item = self.batch(step, pool)
          except Exception as e:  # surfaced in the consumer's thread
            item = e
          while not stop.is_set():
            try:
              out.put(item, timeout=0.1)
              break
            except queue.Full:
              continue
          if isinstance(item, Exception):
            return
          step += 1

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
      while True:
        item = out.get()
        if isinstance(item, Exception):
          raise item
        yield item
    finally:
      stop.set()
      thread.join()
