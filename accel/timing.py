"""Host timing of compiles and of compiled calls: each call waited for (block_until_ready) and timed
on the host, the first `warmup` ones not reported. `accel.fidelity` times its samplers with it, and
so do the benchmarks (`benchmarks/timing.py`)."""
from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable, Iterable, Iterator

import jax


def compiled_in(lowered, compiler_options: dict | None = None) -> tuple[Any, float]:
  """(the compiled program of `lowered`, with XLA `compiler_options`; the compile's seconds)."""
  t0 = time.perf_counter()
  compiled = lowered.compile(compiler_options=compiler_options or None)
  return compiled, time.perf_counter() - t0


def compile_in(pool: concurrent.futures.Executor, name, lowered, compiler_options: dict | None = None):
  """A future of (name, (compiled, compile s)), compiled in `pool` while the caller lowers on (XLA runs
  a program's HLO passes on one thread, so programs compiled side by side overlap; each one's seconds
  are its own wall time, under that contention)."""
  def one():
    compiled, seconds = compiled_in(lowered, compiler_options)
    print(f'compiled {name} in {seconds:.1f} s', flush=True)
    return name, (compiled, seconds)
  return pool.submit(one)


def timed_calls(fn: Callable, calls: Iterable[tuple], warmup: int = 0) -> Iterator[tuple[Any, float]]:
  """fn(*args) for each args of `calls` in turn (taken outside the timed span), each waited for:
  yields (output, seconds) of every call after the first `warmup`."""
  for i, args in enumerate(calls):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    seconds = time.perf_counter() - t0
    if i >= warmup:
      yield out, seconds
