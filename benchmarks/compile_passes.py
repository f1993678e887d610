"""Where XLA's compile time goes: a command run with XLA's own timers on, summarised as the time each
HLO pass took summed over the process's compiles, and each program's HLO passes (its three longest
named) against its backend (LLVM, ptxas).

  python3 benchmarks/compile_passes.py --top 20 -- python3 benchmarks/first_image.py --model infinity_2b \
      --sampler baseline@scan --compilation_cache=
  python3 benchmarks/compile_passes.py -- python3 benchmarks/accelerators.py --models= --mar_sizes huge \
      --mar_presets official --batches 1 --scan off --compile_workers 1 --iters 1 --warmup 0 --compilation_cache=

XLA times every pass of a pass pipeline, and a GPU compile's two halves, at VLOG level 1 of
hlo_pass_pipeline.cc and gpu_compiler.cc (`TF_CPP_VMODULE`), one line a run. A pass that runs in
several pipelines, or several times, is one row of its summed time; a pipeline is a row of its own
too, its passes included. The command's own output passes through; --log keeps XLA's timer lines.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

# Each timer line gives its time rounded in a unit of its choice, then exactly in microseconds, which
# is what is read: "HLO pass: NAME time: 1.2 s (1234 us) (cumulative: ...)" (the cumulative figure is
# of every pass, one timer in the pipeline's loop, so a pass's own times are summed) and
# "GpuCompiler::RunHloPasses for jit__sample time: 45.8 s (45814517 us) (cumulative: ...)".
_PASS = re.compile(r'HLO pass: (\S+) time: [\d.]+ \S+ \((\d+) us\)')
_HALF = re.compile(r'GpuCompiler::(RunHloPasses|RunBackend) for (\S+) time: [\d.]+ \S+ \((\d+) us\)')
_GLOG = re.compile(r'^[IWEF]\d{4} [\d:.]+\s+(\d+) \S+:\d+\] ')


def summarise(lines) -> tuple[dict, list]:
  """XLA's timer lines -> ({pass: (seconds over the process, calls)}, [(half, program, seconds, {pass:
  seconds}), ...]): each half holds the passes its thread ran since that thread's last half (a compile
  runs on one thread, so compiles side by side keep their own)."""
  passes, halves, pending = {}, [], {}
  for line in lines:
    thread = (m[1] if (m := _GLOG.match(line)) else None)
    if m := _PASS.search(line):
      seconds, calls = passes.get(m[1], (0.0, 0))
      passes[m[1]] = (seconds + int(m[2]) / 1e6, calls + 1)
      own = pending.setdefault(thread, {})
      own[m[1]] = own.get(m[1], 0.0) + int(m[2]) / 1e6
    elif m := _HALF.search(line):
      halves.append((m[1], m[2], int(m[3]) / 1e6, pending.pop(thread, {})))
  return passes, halves


def programs(halves) -> list[list]:
  """[(half, program, seconds, passes), ...] in log order -> [[program, HLO passes s, backend s, {pass:
  seconds} of its HLO passes], ...]: each RunBackend joins the latest RunHloPasses of its program that
  has none (compiles of one name pair up)."""
  rows = []
  for half, name, seconds, own in halves:
    if half == 'RunHloPasses':
      rows.append([name, seconds, 0.0, own])
    else:
      row = next((r for r in reversed(rows) if r[0] == name and not r[2]), None)
      if row is None:
        rows.append(row := [name, 0.0, 0.0, {}])
      row[2] = seconds
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--top', type=int, default=15, help='passes to list')
  ap.add_argument('--log', default='', help="also write XLA's timer lines here")
  ap.add_argument('command', nargs=argparse.REMAINDER, help='-- then the command to run')
  args = ap.parse_args()
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not command:
    ap.error('give the command to run after --')
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='0', TF_CPP_VMODULE='hlo_pass_pipeline=1,gpu_compiler=1')
  timers = []
  with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
    for line in proc.stdout:
      if 'HLO pass: ' in line or 'GpuCompiler::Run' in line:
        timers.append(line)
      elif not _GLOG.match(line):   # XLA's other log lines are dropped
        sys.stdout.write(line)
  if args.log:
    with open(args.log, 'w') as f:
      f.writelines(timers)
  passes, halves = summarise(timers)
  print('\n| program, in the order compiled | HLO passes s | backend s | its longest passes s |\n'
        '| --- | ---: | ---: | --- |')
  for name, hlo, backend, own in programs(halves):
    longest = ', '.join(f'{k} {v:.1f}' for k, v in sorted(own.items(), key=lambda kv: -kv[1])[:3])
    print(f'| {name} | {hlo:.1f} | {backend:.1f} | {longest} |')
  print('\n| HLO pass | seconds over the process | runs |\n| --- | ---: | ---: |')
  for name, (seconds, calls) in sorted(passes.items(), key=lambda kv: -kv[1][0])[:args.top]:
    print(f'| {name} | {seconds:.1f} | {calls} |')
  sys.exit(proc.returncode)


if __name__ == '__main__':
  main()
