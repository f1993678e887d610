"""N processes of one GPU each against one process of N GPUs: the same `python -m train` run.

  XLA_FLAGS=--xla_gpu_deterministic_ops=true python benchmarks/multiprocess_gpu.py \
      --config configs/ecar.py:B --gpus 2 --batch 64 --runs many,resume,one,fsdp,single \
      --config.data.cache_latents=True --config.data.num_examples=4096

Runs of the config on the built-in data (its tokenizer random), global batch --batch, seed 0, the
loss logged every step, no checkpoints but the preemption's; --runs picks them, in its order:
  one     one process with GPUs 0..N-1 (mesh data N);
  many    N processes, process i on GPU i (CUDA_VISIBLE_DEVICES=i), joined by the coordinator-address
          variables (NCCL between processes);
  resume  `many` again, SIGTERM to every process (its whole session) after --preempt_at steps, then
          the same commands to the end;
  single  one process of one GPU at the per-GPU batch (--batch / N): the base of the scaling;
  fsdp    `many` with the parameters, EMA and optimizer state split over the N GPUs (mesh fsdp N).
Printed: per run, images/s and MFU over the steps after --warmup (from the times each step's loss
was logged), each process's peak GPU memory, the train state and the step's temporaries per GPU
(XLA's buffer assignment: equal in `single` and `many` where nothing runs on the whole batch on
every GPU) and the start-up phases; the scaling of `one` and `many` over `single`; the largest
relative difference of the losses of `one`, `fsdp` and the resumed run from the reference (`many`,
else `one`), the resumed run's before the preemption too (the run-to-run floor); every run's losses
at full precision. The runs share one
compilation cache and, under --config.data.cache_latents=True, one latent cache (encoded by the
first run). --cpu runs the same on CPU devices (JAX_NUM_CPU_DEVICES) to try the script anywhere.
The processes inherit the environment: under XLA_FLAGS=--xla_gpu_deterministic_ops=true GPU
reductions are deterministic, the run-to-run floor is 0 and layouts that reduce in the same order
give equal losses (two H200s: benchmarks/RESULTS.md). XLA does not run cuDNN's masked attention
backward in that mode: deterministic runs of VAR (bfloat16, scale-causal) take
--config.attn_backend=xla.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile

import numpy as np

from train import launch
from train.summaries import read_scalars


def devices_env(args, first: int, count: int) -> dict:
  if args.cpu:
    return {'JAX_PLATFORMS': 'cpu', 'JAX_NUM_CPU_DEVICES': str(count)}
  return {'CUDA_VISIBLE_DEVICES': ','.join(str(first + i) for i in range(count))}


def job(args, base: str, name: str, processes: int, devices: int, batch: int, extra=()) -> launch.Job:
  """`python -m train` in BASE/NAME as `processes` processes of `devices` GPUs each."""
  workdir = os.path.join(base, name)
  os.makedirs(workdir, exist_ok=True)
  if not os.path.lexists(os.path.join(workdir, 'latents')):
    os.symlink(os.path.join(base, 'latents'), os.path.join(workdir, 'latents'))
  train = ['-m', 'train', f'--config={args.config}', f'--workdir={workdir}', f'--config.train.steps={args.steps}',
           f'--config.train.batch_size={batch}', '--config.train.log_every=1',
           '--config.train.ckpt_every=1000000000', '--config.train.sample_classes=0',
           '--config.data.source=synthetic', f'--config.data.workers={args.workers}',
           f'--compilation_cache={args.compilation_cache}', *args.extra, *extra]
  envs = [devices_env(args, i * devices, devices) for i in range(processes)]
  return launch.Job(os.path.join(workdir, 'logs'), [train] * processes, envs)


def startup_seconds(j: launch.Job) -> list[dict]:
  """Per process, {phase: seconds} of `python -m train`'s start-up (train/startup.py's log lines)."""
  return [{name: float(sec) for name, sec in re.findall(r'start-up: ([^\n]+?): ([0-9.]+) s\n', j.err(i))}
          for i in range(len(j.procs))]


def report(args, workdir: str, j: launch.Job, batch: int, first: int = 0) -> dict:
  """The run's losses, memory, start-up; images/s over steps first + --warmup .. --steps from the
  times the loss was logged (each step logs it after a device sync), MFU in proportion."""
  scalars = read_scalars(os.path.join(workdir, 'tensorboard'), wall_time=True)
  logged = {step: t for step, _, t in scalars['loss']}
  start = first + args.warmup
  images_per_s = batch * (args.steps - start) / (logged[args.steps] - logged[start])
  mfu = None
  if 'perf/mfu' in scalars:   # absent where the device's peak is unknown (the CPU)
    mfu = images_per_s * statistics.median(m / i for (_, m, _), (_, i, _) in
                                           zip(scalars['perf/mfu'], scalars['perf/images_per_s']))
  last = lambda pattern, i: (re.findall(pattern, j.out(i)) or [None])[-1]
  return {'losses': {step: value for step, value, _ in scalars['loss']}, 'images_per_s': images_per_s,
          'mfu': mfu,
          'memory_gib': [last(r'peak device memory ([0-9.]+) GiB', i) for i in range(len(j.procs))],
          'state_gib': last(r'train state per device: (params [^\n]+)', 0),
          'temporaries_gib': last(r'train step per device: temporaries ([0-9.]+) GiB', 0), 'startup': startup_seconds(j)}


def max_relative(a: dict, b: dict, steps) -> float:
  x, y = np.array([a[s] for s in steps]), np.array([b[s] for s in steps])
  return float(np.max(np.abs(x - y) / np.abs(y)))


def preempted_and_resumed(args, base: str) -> tuple[int, dict]:
  """SIGTERM to every process of an N-process run after --preempt_at steps, then the same commands."""
  with job(args, base, 'resume', args.gpus, 1, args.batch) as cut:
    cut.wait_for_step(args.preempt_at, args.timeout)
    for i in range(len(cut.procs)):
      cut.signal(i, signal.SIGTERM)
    cut.succeed(args.timeout)
  stopped = re.search(r'stopped at step (\d+)', cut.out(0))
  if not stopped or int(stopped.group(1)) + args.warmup >= args.steps:
    raise RuntimeError(f'the run ended before SIGTERM stopped it (sent at step {args.preempt_at}) or too '
                       'close to the end to time the resumed steps: raise --steps')
  stopped = int(stopped.group(1))
  with job(args, base, 'resume', args.gpus, 1, args.batch) as again:
    again.succeed(args.timeout)
  return stopped, report(args, os.path.join(base, 'resume'), again, args.batch, first=stopped)


def print_tables(rows: dict) -> None:
  print('| run | images/s | MFU | peak memory per process GiB | train state per GPU (process 0) | step temporaries GiB |\n'
        '| --- | ---: | ---: | --- | --- | ---: |')
  for name, r in rows.items():
    ips = f"{r['images_per_s']:.1f}" if r['images_per_s'] else '-'
    mfu = f"{100 * r['mfu']:.1f} %" if r['mfu'] else '-'
    print(f"| {name} | {ips} | {mfu} | {', '.join(m or '-' for m in r['memory_gib'])} | {r['state_gib'] or '-'} | "
          f"{r['temporaries_gib'] or '-'} |")
  phases = list(next(iter(rows.values()))['startup'][0])
  print('\nstart-up, seconds per phase (slowest process)\n| run | ' + ' | '.join(phases) + ' |\n|' + ' --- |' * (len(phases) + 1))
  for name, r in rows.items():
    slowest = {k: max(p.get(k, 0.0) for p in r['startup']) for k in phases}
    print(f'| {name} | ' + ' | '.join(f'{slowest[k]:.1f}' for k in phases) + ' |')


def parse_args():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--config', default='configs/ecar.py:B')
  p.add_argument('--gpus', type=int, default=2)
  p.add_argument('--steps', type=int, default=40)
  p.add_argument('--batch', type=int, default=64, help='global batch')
  p.add_argument('--runs', default='one,many,resume', help='comma-separated: one, many, resume, single, fsdp')
  p.add_argument('--preempt_at', type=int, default=8)
  p.add_argument('--warmup', type=int, default=5)
  p.add_argument('--workers', type=int, default=4, help='data worker processes per process')
  p.add_argument('--timeout', type=float, default=900)
  p.add_argument('--cpu', action='store_true')
  p.add_argument('--workdir', default='')
  p.add_argument('--compilation_cache', default=None,
                 help='shared by the runs (default WORKDIR/xla_cache: a later run loads what an earlier compiled)')
  args, args.extra = p.parse_known_args()   # the rest: --config.KEY=VALUE overrides for every run
  args.runs = args.runs.split(',')
  unknown = set(args.runs) - {'one', 'many', 'resume', 'single', 'fsdp'}
  if unknown or (args.gpus == 1 and {'many', 'fsdp'} & set(args.runs)):
    raise SystemExit(f'--runs: unknown {sorted(unknown)}, or many/fsdp with --gpus 1')
  return args


def print_comparisons(args, rows: dict, names: dict, stopped: int) -> None:
  ips = {k: r['images_per_s'] for k, r in rows.items()}
  for k in ('one', 'many'):
    if k in ips and 'single' in ips:
      print(f'scaling of {names[k]} over 1 GPU: {ips[k] / ips["single"]:.2f}x')
  steps = range(1, args.steps + 1)
  reference = 'many' if 'many' in rows else 'one'
  for k in ('one', 'many', 'fsdp'):
    if k != reference and k in rows and reference in rows:
      print(f'losses, {names[k]} against {names[reference]}: max relative difference '
            f'{max_relative(rows[k]["losses"], rows[reference]["losses"], steps):.2e}')
  if 'resume' in rows and reference in rows:
    resumed, ref = rows['resume']['losses'], rows[reference]['losses']
    print(f'preempted at step {stopped} and resumed: max relative difference of steps {stopped + 1}..{args.steps} '
          f'from {names[reference]} {max_relative(resumed, ref, range(stopped + 1, args.steps + 1)):.2e}; of steps '
          f'1..{stopped}, before the preemption (the run-to-run floor) {max_relative(resumed, ref, range(1, stopped + 1)):.2e}')
  for k, r in rows.items():
    print(f'losses, {names[k]}:', ' '.join(f'{r["losses"][s]:.7g}' for s in steps))


def main():
  signal.signal(signal.SIGTERM, lambda *_: sys.exit('multiprocess_gpu.py: SIGTERM; its runs are ended'))
  args = parse_args()
  base = args.workdir or tempfile.mkdtemp()
  os.makedirs(os.path.join(base, 'latents'), exist_ok=True)
  if args.compilation_cache is None:
    args.compilation_cache = os.path.join(base, 'xla_cache')
  n, rows, stopped = args.gpus, {}, 0
  layouts = {'one': (1, n, args.batch, ()), 'many': (n, 1, args.batch, ()), 'single': (1, 1, args.batch // n, ()),
             'fsdp': (n, 1, args.batch, ('--config.train.mesh_data=1', f'--config.train.mesh_fsdp={n}'))}
  names = {'one': f'1 process x {n} GPUs', 'many': f'{n} processes x 1 GPU', 'single': '1 process x 1 GPU',
           'fsdp': f'{n} processes x 1 GPU, FSDP {n}', 'resume': f'{n} processes x 1 GPU, preempted and resumed'}
  for run in args.runs:
    if run == 'resume':
      stopped, rows['resume'] = preempted_and_resumed(args, base)
    else:
      with job(args, base, run, *layouts[run]) as j:
        j.succeed(args.timeout)
      rows[run] = report(args, os.path.join(base, run), j, layouts[run][2])
    r = rows[run]   # printed as each run ends, in case a later one does not
    print(f"{names[run]}: {r['images_per_s']:.1f} images/s, MFU {r['mfu']}, peak GiB {r['memory_gib']}, "
          f"{r['state_gib']}, start-up {r['startup']}", flush=True)
  print(f'{args.config}, global batch {args.batch}, {args.steps} steps, {" ".join(args.extra)}')
  print_tables({names[k]: r for k, r in rows.items()})
  print_comparisons(args, rows, names, stopped)


if __name__ == '__main__':
  main()
