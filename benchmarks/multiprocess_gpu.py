"""N processes of one GPU each against one process of N GPUs: the same `python -m train` run.

  python benchmarks/multiprocess_gpu.py --config configs/ecar.py:B --gpus 2 --steps 20 --batch 64

Three runs of the config on the built-in data (its tokenizer random), global batch --batch,
seed 0, the loss logged every step, no checkpoints but the preemption's:
  1. one process with GPUs 0..N-1 (mesh data N);
  2. N processes, process i on GPU i (CUDA_VISIBLE_DEVICES=i), joined by the coordinator-address
     variables (NCCL between processes);
  3. run 2 again, SIGTERM to every process (its whole session) after --preempt_at steps, then
     the same commands to the end.
Printed: the largest relative difference of the N-process losses from the one-process ones
(run 2) and of the resumed run's from run 2's (run 3: after the preemption, and before it as
the floor that GPU reductions, not deterministic, set); images/s and MFU of runs 1 and 2
(medians of the per-step TensorBoard values after --warmup steps); each process's peak GPU
memory. --gpus 1 runs 1 and the preemption of 3 on one process (N processes need N GPUs).
--cpu runs the same on CPU devices (JAX_NUM_CPU_DEVICES) to try the script anywhere.
The processes inherit the environment: under XLA_FLAGS=--xla_gpu_deterministic_ops=true the GPU
floor is 0 and a resume equals the uninterrupted run exactly (one H100: benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import tempfile

import numpy as np

from train import launch
from train.summaries import read_scalars


def devices_env(args, first: int, count: int) -> dict:
  if args.cpu:
    return {'JAX_PLATFORMS': 'cpu', 'JAX_NUM_CPU_DEVICES': str(count)}
  return {'CUDA_VISIBLE_DEVICES': ','.join(str(first + i) for i in range(count))}


def job(args, workdir: str, processes: int) -> launch.Job:
  train = ['-m', 'train', f'--config={args.config}', f'--workdir={workdir}', f'--config.train.steps={args.steps}',
           f'--config.train.batch_size={args.batch}', '--config.train.log_every=1',
           '--config.train.ckpt_every=1000000000', '--config.train.sample_classes=0',
           '--config.data.source=synthetic', f'--config.data.workers={args.workers}',
           f'--compilation_cache={args.compilation_cache}', *args.extra]
  per = args.gpus // processes
  envs = [devices_env(args, i * per, per) for i in range(processes)]
  return launch.Job(os.path.join(workdir, 'logs'), [train] * processes, envs)


def startup_seconds(j: launch.Job) -> list[dict]:
  """Per process, {phase: seconds} of `python -m train`'s start-up (train/startup.py's log lines)."""
  return [{name: float(sec) for name, sec in re.findall(r'start-up: ([^\n]+?): ([0-9.]+) s\n', j.err(i))}
          for i in range(len(j.procs))]


def report(args, workdir: str, j: launch.Job) -> dict:
  scalars = read_scalars(os.path.join(workdir, 'tensorboard'))
  after = lambda tag: [v for s, v in scalars.get(tag, []) if s > args.warmup]
  memory = [re.findall(r'peak device memory ([0-9.]+) GiB', j.out(i)) for i in range(len(j.procs))]
  return {'losses': dict(scalars['loss']),
          'images_per_s': statistics.median(after('perf/images_per_s')) if after('perf/images_per_s') else None,
          'mfu': statistics.median(after('perf/mfu')) if after('perf/mfu') else None,
          'memory_gib': [float(m[-1]) if m else None for m in memory], 'startup': startup_seconds(j)}


def max_relative(a: dict, b: dict, steps) -> float:
  x, y = np.array([a[s] for s in steps]), np.array([b[s] for s in steps])
  return float(np.max(np.abs(x - y) / np.abs(y)))


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--config', default='configs/ecar.py:B')
  p.add_argument('--gpus', type=int, default=2)
  p.add_argument('--steps', type=int, default=20)
  p.add_argument('--batch', type=int, default=64, help='global batch')
  p.add_argument('--preempt_at', type=int, default=8)
  p.add_argument('--warmup', type=int, default=3)
  p.add_argument('--workers', type=int, default=4, help='data worker processes per process')
  p.add_argument('--timeout', type=float, default=900)
  p.add_argument('--cpu', action='store_true')
  p.add_argument('--workdir', default='')
  p.add_argument('--compilation_cache', default=None,
                 help='shared by the runs (default WORKDIR/xla_cache: runs 3 and 4 load the programs run 2 compiled)')
  args, args.extra = p.parse_known_args()   # the rest: --config.KEY=VALUE overrides for every run
  base = args.workdir or tempfile.mkdtemp()
  if args.compilation_cache is None:
    args.compilation_cache = os.path.join(base, 'xla_cache')
  n = args.gpus
  rows = []
  one_dir = os.path.join(base, 'one')
  one = job(args, one_dir, 1)
  one.succeed(args.timeout)
  rows.append((f'1 process x {n} device{"s" * (n > 1)}', report(args, one_dir, one)))
  if n > 1:
    many_dir = os.path.join(base, 'many')
    many = job(args, many_dir, n)
    many.succeed(args.timeout)
    rows.append((f'{n} processes x 1 device', report(args, many_dir, many)))
  reference = rows[-1][1]['losses']
  cut_dir = os.path.join(base, 'preempted')
  cut = job(args, cut_dir, n)
  cut.wait_for_step(args.preempt_at, args.timeout)
  for i in range(len(cut.procs)):
    cut.signal(i, signal.SIGTERM)
  cut.succeed(args.timeout)
  stopped = int(re.search(r'stopped at step (\d+)', cut.out(0)).group(1))
  again = job(args, cut_dir, n)
  again.succeed(args.timeout)
  resumed_report = report(args, cut_dir, again)
  resumed = resumed_report['losses']
  rows.append(('resumed, from the compilation cache', resumed_report))

  print(f'{args.config}, global batch {args.batch}, {args.steps} steps')
  print('| run | images/s | MFU | peak memory per process GiB |\n| --- | ---: | ---: | --- |')
  for name, r in rows:
    ips = f"{r['images_per_s']:.1f}" if r['images_per_s'] else '-'
    mfu = f"{100 * r['mfu']:.1f} %" if r['mfu'] else '-'
    print(f"| {name} | {ips} | {mfu} | {', '.join('-' if m is None else f'{m:.2f}' for m in r['memory_gib'])} |")
  phases = list(rows[0][1]['startup'][0])
  print('\nstart-up, seconds per phase (slowest process)\n| run | ' + ' | '.join(phases) + ' |\n|' + ' --- |' * (len(phases) + 1))
  for name, r in rows:
    slowest = {k: max(p.get(k, 0.0) for p in r['startup']) for k in phases}
    print(f'| {name} | ' + ' | '.join(f'{slowest[k]:.1f}' for k in phases) + ' |')
  steps = range(1, args.steps + 1)
  if n > 1:
    print(f'losses, {n} processes against 1: max relative difference {max_relative(rows[1][1]["losses"], rows[0][1]["losses"], steps):.2e}')
  print(f'preempted at step {stopped} and resumed: max relative difference of steps {stopped + 1}..{args.steps} '
        f'from the uninterrupted run {max_relative(resumed, reference, range(stopped + 1, args.steps + 1)):.2e}; '
        f'of steps 1..{stopped}, before the preemption (the run-to-run floor: GPU reductions are not '
        f'deterministic) {max_relative(resumed, reference, range(1, stopped + 1)):.2e}')
  print('losses:', ' '.join(f'{reference[s]:.5f}' for s in steps))


if __name__ == '__main__':
  main()
