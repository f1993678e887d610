"""A MAR sampler's call as programs of its own, driven by a host loop (`make_mar_sampler(...,
host_loop=True)`): the start, a run program for each distinct iteration body (a plan's model part at
one encoder length, then one head cache), and the decoder. A run program is a scan over consecutive
iterations of its body, as many as the gcd of the lengths of that body's runs in the schedule, so
each run is one or a few calls. Each program is compiled once, all side by side (XLA runs a
program's passes on one thread, so a few small programs compile in a fraction of the time of one
that holds them all), and the host calls them in turn, the carry (tokens, the policy's state)
donated from one to the next and updated in place, so the buffers each program reads stay put from
call to call and XLA replays the CUDA graphs it recorded for them as they are (re-recording them
whenever an address moved cost the host 157 ms of a 490 ms LazyMAR call on MAR-H).

A run has no conditional: the one program's scan switches between its trunks, and XLA reads each
switch's branch index back on the host, which leaves the device idle for a moment 64 times a call
(14 ms of LazyMAR's on MAR-H). MAR-H with LazyMAR `official` at batch 1 has two bodies: refreshes
(iterations 0-5 and 14, 23, ..., 59: one iteration a call) and cached iterations (in runs of 8 and
4: four a call), 25 calls. benchmarks/RESULTS.md ("MAR's iterations as programs of their own" and
the sections after it) has what each form costs."""
from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class HostLoop:
  """The programs of one call, lowered (as the sampler's `lower` gives them) or compiled (`compile()`,
  then called as a compiled program is, with the arguments `sample.arguments(...)` gives):
  `begin(*args) -> (cast, ctx, carry)`, `runs[r](weights, head, ctx, carry) -> (carry, records or
  None)` (records stacked over its lengths[r] iterations), `finish(params, tokens) -> (images,
  aux)`, where `weights(params, cast) -> (weights, head)` merges trees on the host (nothing
  computed); the call runs runs[order[k]] for k = 0, 1, ..."""
  begin: Any
  runs: list
  finish: Any
  weights: Callable
  order: tuple[int, ...]
  lengths: tuple[int, ...]

  def programs(self) -> list:
    """[begin, *runs, finish]."""
    return [self.begin, *self.runs, self.finish]

  def compile(self, compiler_options: Optional[dict] = None) -> 'HostLoop':
    """Every program compiled, all at once on threads of their own."""
    parts = self.programs()
    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
      done = list(pool.map(lambda p: p.compile(compiler_options=compiler_options), parts))
    return dataclasses.replace(self, begin=done[0], runs=done[1:-1], finish=done[-1])

  def __call__(self, *args):
    params = args[0]
    cast, ctx, carry = self.begin(*args)
    weights, head = self.weights(params, cast)
    records = []
    for r in self.order:
      carry, record = self.runs[r](weights, head, ctx, carry)
      records.append(record)
    images, aux = self.finish(params, carry['tokens'])
    if records[0] is not None:
      aux['iterations'] = jax.tree.map(lambda *a: jnp.concatenate(a), *records)
    return images, aux

  def memory_analysis(self):
    """XLA's memory analysis of the compiled program that holds the most (arguments + outputs +
    temporaries - aliased): the call's peak, the weights and the carry being every run's
    arguments."""
    analyses = [p.memory_analysis() for p in self.programs()]
    if any(m is None for m in analyses):
      return None
    return max(analyses, key=lambda m: (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                                        - m.alias_size_in_bytes))
