"""What a program's launch costs on the device, against the same work inside one program's loop:
the measure of a host loop's edges (`var_models.mar.host_loop`), by the leaves its carry holds.

  python3 benchmarks/dispatch_cost.py --leaves 0,16,128 --steps 1,8 --calls 256
  python benchmarks/dispatch_cost.py --rows 2 --width 64 --calls 8 --leaves 0,2   # on a CPU

A step is x <- x + tanh(x @ w) (x [rows, width], w [width, width], bf16). A program runs `steps`
of them and passes `leaves` more arrays [rows, width] through untouched; every argument but w is
donated, so each output is written in its input's place, as the host loop's parts do. Timed, each
after a warm-up, medians of --iters (`timing.step_times`, each call waited for):
  - host loop: `calls` calls of the program from the host, the carry handed from one to the next;
  - one program: a `fori_loop` of `calls` iterations of the same body, the leaves in its carry.
The difference per call is what one launch and its arguments cost beyond the work itself.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from timing import step_times


def body(steps: int, w, x, leaves):
  """`steps` steps on x [rows, width]; the leaves as they came."""
  for _ in range(steps):
    x = x + jnp.tanh(x @ w)
  return x, leaves


def measure(rows: int, width: int, steps: int, leaves: int, calls: int, iters: int) -> dict:
  """{'host loop': us a call, 'one program': us an iteration} for one setting."""
  key = jax.random.key(0)
  w = (jax.random.normal(key, (width, width)) / width ** 0.5).astype(jnp.bfloat16)
  fresh = lambda: (jnp.ones((rows, width), jnp.bfloat16),
                   [jnp.full((rows, width), i, jnp.bfloat16) for i in range(leaves)])
  part = jax.jit(functools.partial(body, steps), donate_argnums=(1, 2))

  def host_loop():
    x, rest = fresh()
    for _ in range(calls):
      x, rest = part(w, x, rest)
    return x, rest

  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def looped(w, x, rest):
    return jax.lax.fori_loop(0, calls, lambda _, c: body(steps, w, *c), (x, rest))

  ms = lambda run: step_times(run, 1, iters)[0]['synced']
  setup = ms(fresh)
  return {name: 1e3 * (ms(run) - setup) / calls
          for name, run in (('host loop', host_loop), ('one program', lambda: looped(w, *fresh())))}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--rows', type=int, default=8)
  ap.add_argument('--width', type=int, default=1280)
  ap.add_argument('--steps', default='1,8', help='steps a program runs')
  ap.add_argument('--leaves', default='0,16,128', help='arrays the carry passes through')
  ap.add_argument('--calls', type=int, default=256)
  ap.add_argument('--iters', type=int, default=9)
  args = ap.parse_args()
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}; x [{args.rows}, {args.width}], '
        f'{args.calls} calls', flush=True)
  print('steps | leaves | host loop us a call | one program us an iteration | difference us')
  for steps in map(int, args.steps.split(',')):
    for leaves in map(int, args.leaves.split(',')):
      us = measure(args.rows, args.width, steps, leaves, args.calls, args.iters)
      print(f'{steps} | {leaves} | {us["host loop"]:.2f} | {us["one program"]:.2f} | '
            f'{us["host loop"] - us["one program"]:.2f}', flush=True)


if __name__ == '__main__':
  main()
