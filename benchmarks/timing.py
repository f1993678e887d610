"""Timing compiled samplers: compile apart, median of host-timed calls after warm-up."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import jax


def time_compiled(lowered, make_args: Callable[[int], tuple], batch: int, warmup: int, iters: int):
  """Compiles `lowered`, then times calls with make_args(i) (fresh keys per call).

  Returns (compiled, row) with compile seconds and median / min / max milliseconds.
  """
  t0 = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  times = []
  for i in range(warmup + iters):
    args = make_args(i)
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    if i >= warmup:
      times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  return compiled, dict(compile_s=compile_s, median_ms=med * 1e3, per_image_ms=med * 1e3 / batch,
                        min_ms=min(times) * 1e3, max_ms=max(times) * 1e3)


def entry_op_counts(compiled) -> dict:
  """Instructions of the compiled program's entry computation by opcode (kernel-launch proxy)."""
  text = compiled.as_text()
  entry = text[text.index('ENTRY'):]
  entry = entry[:entry.index('\n}')]
  counts = {}
  for line in entry.splitlines()[1:]:
    if ' = ' in line:
      rhs = line.split(' = ', 1)[1].split('(', 1)[0].split()
      op = rhs[-1] if rhs else '?'
      counts[op] = counts.get(op, 0) + 1
  return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:8])
