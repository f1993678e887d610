"""MAR's sampler driven from the host (`host_loop=True`) against its one program, in one process:
calls timed in alternating rounds, and where the host loop's host time goes.

  python3 benchmarks/mar_host_loop.py --size huge --sampler lazymar:official --compilation_cache=
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \
    python3 benchmarks/mar_host_loop.py --size huge --rounds 0 --compilation_cache= 2> /tmp/xla.log
  python3 benchmarks/mar_host_loop.py --updates /tmp/xla.log
  python benchmarks/mar_host_loop.py --size tiny --attn xla --dtype float32 --overrides num_iter=4,num_steps=4 \
    --sampler baseline --rounds 1 --iters 1   # on a CPU

The one program is compiled first, so the host loop's parts reuse XLA's autotuning picks for the
fusions they share with it (what a second sampler in a process gets; `accelerators.py` compiles
each cold). `--attn cudnn,xla` builds both for each attention backend, every time printed over the
fastest one program's. Rounds alternate them all (--iters calls each after --warmup, the median),
so drift in the GPU's clock falls on each. The host-time line splits one host-loop call into the
milliseconds the host spent inside the runs' calls and the wait for the device after the last.

--profile DIR traces one call of each under DIR and prints its device time by kernel and the host
events under the device's longest idle gaps (`timing.print_top_device_ops`; while the profiler
runs, XLA replays no CUDA graph but launches their kernels one by one, so the launches' own cost
differs from an untraced call).

With XLA's command-buffer log (the second command), `--updates LOG` counts the CUDA graphs XLA
re-recorded after the timed marker, by their command count: a graph is re-recorded whenever a
buffer it reads has moved since its last launch.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time

import jax

from accel.timing import compiled_in
from accelerators import family_config, family_job, family_layouts
from sampling import compilation_cache
from timing import call_times, print_top_device_ops, settings, xla_variants

MARKER = 'mar_host_loop: timed calls start'


def host_split(loop, args) -> dict:
  """Milliseconds of one call of a compiled `HostLoop` on `args`: all of it, the host's time inside
  its runs' calls, and the wait for the device after the decoder's call."""
  t0 = time.perf_counter()
  cast, ctx, carry = loop.begin(*args)
  weights, head = loop.weights(args[0], cast)
  inside = collections.Counter()
  for r in loop.order:
    s = time.perf_counter()
    carry, _ = loop.runs[r](weights, head, ctx, carry)
    inside['runs'] += time.perf_counter() - s
  out = loop.finish(args[0], carry['tokens'])
  s = time.perf_counter()
  jax.block_until_ready(out)
  inside['wait'] = time.perf_counter() - s
  return {'call': 1e3 * (time.perf_counter() - t0), **{k: 1e3 * v for k, v in inside.items()}}


def graph_updates(log: str) -> dict[int, tuple[int, int]]:
  """{commands in a CUDA graph: (its re-recordings, their microseconds)} from XLA's command-buffer
  log after MARKER."""
  out = collections.defaultdict(lambda: [0, 0])
  for us, n in re.findall(r'Updated command buffer in (\d+) .s; num_commands=(\d+)', log.split(MARKER)[-1]):
    out[int(n)][0] += 1
    out[int(n)][1] += int(us)
  return {n: tuple(v) for n, v in out.items()}


def print_graph_updates(path: str) -> None:
  """`graph_updates` of the log at `path`, the costliest graphs first."""
  with open(path, errors='replace') as f:
    for n, (count, us) in sorted(graph_updates(f.read()).items(), key=lambda kv: -kv[1][1]):
      print(f'graph of {n} commands: re-recorded {count} times, {us / 1e3:.1f} ms')


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--size', default='huge', help='a config of configs/mar.py')
  ap.add_argument('--sampler', default='lazymar:official', help="a policy spec or 'baseline'")
  ap.add_argument('--batch', type=int, default=1)
  ap.add_argument('--dtype', default='bfloat16')
  ap.add_argument('--attn', default='cudnn', help="attention backends, 'a,b': each with its one program "
                  'and its host loop, every time over the fastest one program')
  ap.add_argument('--xla', default='', help="';'-separated sets of XLA options ('a=1,b=true'), each compiling "
                  "every host loop's parts apart (rows 'host loop (attn, set)'; '' is XLA's defaults)")
  ap.add_argument('--overrides', default='', help="sampling settings over accelerators.FAMILY_OVERRIDES "
                  "('key=value,...')")
  ap.add_argument('--rounds', type=int, default=3)
  ap.add_argument('--iters', type=int, default=9)
  ap.add_argument('--warmup', type=int, default=2)
  ap.add_argument('--profile', default='', help='trace one call of each under this folder')
  ap.add_argument('--updates', default='', help="a log of the second command: count its graphs' re-recordings")
  args = compilation_cache.parse_args(ap)
  if args.updates:
    print_graph_updates(args.updates)
    return
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  runs = {}
  for attn in args.attn.split(','):
    config = family_config('mar', args.size, args.dtype, attn)
    for kind, host_loop in (('one program', False), ('host loop', True)):
      family, makes, params = family_layouts(config, 'off', {**settings(args.overrides), 'host_loop': host_loop})
      _, lowered, make_args = family_job(family, makes, params, args.sampler, args.batch)
      for spec, options in zip(args.xla.split(';'), xla_variants(args.xla)) if host_loop else [('', {})]:
        compiled, seconds = compiled_in(lowered, options)
        name = f'{kind} ({attn}{", " + spec if spec else ""})'
        runs[name] = compiled, make_args
        print(f'{name}: compiled in {seconds:.1f} s', flush=True)
  loops = {name: run for name, run in runs.items() if name.startswith('host loop')}
  for loop, make_args in loops.values():
    for i in range(args.warmup):
      jax.block_until_ready(loop(*make_args(i)))
  print(MARKER, file=sys.stderr, flush=True)
  for name, (loop, make_args) in loops.items():
    split = host_split(loop, jax.block_until_ready(make_args(args.warmup)))
    print(f'{name}, one call (ms): ' + ', '.join(f'{k} {v:.1f}' for k, v in split.items()), flush=True)
  for r in range(args.rounds):
    ms = {name: 1e3 * statistics.median(call_times(fn, ma, args.warmup, args.iters)) for name, (fn, ma) in runs.items()}
    fastest = min(v for name, v in ms.items() if name.startswith('one program'))
    print(f'round {r}: ' + ', '.join(f'{name} {v:.1f} ms ({v / fastest:.3f}x)' for name, v in ms.items()), flush=True)
  for name, (fn, ma) in runs.items() if args.profile else ():
    print(f'{name}, one call traced:', flush=True)
    call = ma(0)
    print_top_device_ops(lambda: jax.block_until_ready(fn(*call)),
                         os.path.join(args.profile, re.sub(r'\W+', '_', name).strip('_')))


if __name__ == '__main__':
  main()
