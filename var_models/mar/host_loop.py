"""A MAR sampler's call as programs of its own, driven by a host loop (`make_mar_sampler(...,
host_loop=True)`): the start, each distinct trunk (a plan's model part at an encoder length) and
head (a head cache's sampling loop), and the decoder. Each is compiled once, all side by side (XLA
runs a program's passes on one thread, so a few small programs compile in a fraction of the time
of one that holds them all), and the host calls each iteration's trunk, then its head, the carry
(tokens, the policy's state, the iteration's conditions) donated from one to the next and updated
in place, so the buffers each program reads stay put from call to call and XLA replays the CUDA
graphs it recorded for them as they are (re-recording them whenever an address moved cost the
host 157 ms of a 490 ms LazyMAR call on MAR-H). A call's host time grows with its arguments'
leaves, so the heads take only the head's weights and the trunks MAR's, cast once a call.

benchmarks/RESULTS.md ("MAR's iterations as programs of their own", "the host loop's parts write
their carry in place", "each head with the next trunk") has what it costs at run time: the trunk
and the head of an iteration fused into one program ran slower than apart (measured while buffers
still moved), and so did each head with the next iteration's trunk, 6-7 % (buffers in place)."""
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
  `begin(*args) -> (cast, ctx, carry)`, `trunks[t](weights, ctx, carry) -> (carry, record or None)`,
  `heads[h](head, ctx, carry) -> (carry, sampled tokens or None)` (None where nothing is recorded),
  `finish(params, tokens) -> (images, aux)`, where `weights(params, cast) -> (weights, head)` merges
  trees on the host (nothing computed); iteration k runs trunks[trunk_ids[k]], then heads[head_ids[k]]."""
  begin: Any
  trunks: list
  heads: list
  finish: Any
  weights: Callable
  trunk_ids: tuple[int, ...]
  head_ids: tuple[int, ...]

  def programs(self) -> list:
    """[begin, *trunks, *heads, finish]."""
    return [self.begin, *self.trunks, *self.heads, self.finish]

  def compile(self, compiler_options: Optional[dict] = None) -> 'HostLoop':
    """Every program compiled, all at once on threads of their own."""
    parts = self.programs()
    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
      done = list(pool.map(lambda p: p.compile(compiler_options=compiler_options), parts))
    t = len(self.trunks)
    return dataclasses.replace(self, begin=done[0], trunks=done[1:1 + t], heads=done[1 + t:-1], finish=done[-1])

  def __call__(self, *args):
    params = args[0]
    cast, ctx, carry = self.begin(*args)
    weights, head = self.weights(params, cast)
    records = []
    for t, h in zip(self.trunk_ids, self.head_ids):
      carry, record = self.trunks[t](weights, ctx, carry)
      carry, sampled = self.heads[h](head, ctx, carry)
      records.append(None if record is None else {**record, 'sampled': sampled})
    images, aux = self.finish(params, carry['tokens'])
    if records[0] is not None:
      aux['iterations'] = jax.tree.map(lambda *a: jnp.stack(a), *records)
    return images, aux

  def memory_analysis(self):
    """XLA's memory analysis of the compiled program that holds the most (arguments + outputs +
    temporaries - aliased): the call's peak, the weights and the carry being every iteration's
    arguments."""
    analyses = [p.memory_analysis() for p in self.programs()]
    if any(m is None for m in analyses):
      return None
    return max(analyses, key=lambda m: (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                                        - m.alias_size_in_bytes))
