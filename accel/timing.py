"""Host timing of compiles and of compiled calls: each call waited for (block_until_ready) and timed
on the host, the first `warmup` ones not reported. `accel.fidelity` times its samplers with it, and
so do the benchmarks (`benchmarks/timing.py`)."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator

import jax


def compiled_in(lowered, compiler_options: dict | None = None) -> tuple[Any, float]:
  """(the compiled program of `lowered`, with XLA `compiler_options`; the compile's seconds)."""
  t0 = time.perf_counter()
  compiled = lowered.compile(compiler_options=compiler_options or None)
  return compiled, time.perf_counter() - t0


def timed_calls(fn: Callable, calls: Iterable[tuple], warmup: int = 0) -> Iterator[tuple[Any, float]]:
  """fn(*args) for each args of `calls` in turn (taken outside the timed span), each waited for:
  yields (output, seconds) of every call after the first `warmup`."""
  for i, args in enumerate(calls):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    seconds = time.perf_counter() - t0
    if i >= warmup:
      yield out, seconds
