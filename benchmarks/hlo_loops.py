"""What each loop body of an optimised XLA program runs: its copies, GEMMs and attention calls.

  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" python3 benchmarks/accelerators.py ... --scan on
  python3 benchmarks/hlo_loops.py /tmp/dump/module_*.jit__sample.*after_optimizations.txt

One row per `while` of the program (a scan over stacked blocks, a sampler's iterations): the
asynchronous slices it starts, which XLA runs as device copies (weight-sized, more than
--big elements, and small), its plain dynamic slices, its GEMMs (XLA's Triton fusions, cuBLAS
calls, Pallas kernels), its cuDNN attention calls, its reduction fusions (split-K GEMMs end in
one), its kernels in all, and the most rows of its [rows, --width] activations. A scanned block
that reads its weights in place starts no weight-sized copy.
"""
from __future__ import annotations

import argparse
import collections
import math
import re

# (column, pattern an instruction line matches); an instruction counts in every column it matches.
KINDS = (('Triton GEMMs', r'= \S+ fusion\(.*kind=kCustom, calls=%gemm_fusion'),
         ('cuBLAS', r'custom_call_target="__cublas'),
         ('Pallas', r'custom_call_target="__gpu\$xla\.gpu\.triton"'),
         ('cuDNN attention', r'custom_call_target="__cudnn\$fmha'),
         ('reductions', r'= \S+ fusion\(.*calls=%fused_reduce'),
         ('dynamic slices', r'= \S+ dynamic-slice\('),
         ('kernels', r' (fusion|custom-call)\('))


def computations(text: str) -> dict[str, list[str]]:
  """{computation name: its instruction lines} of an HLO module's text."""
  comps, name = {}, None
  for line in text.splitlines():
    head = re.match(r'^(?:ENTRY )?(%\S+) .*\{$', line)
    if head:
      name = head.group(1)
      comps[name] = []
    elif line.startswith('}'):
      name = None
    elif name:
      comps[name].append(line)
  return comps


def body_row(lines: list[str], big: int, width: int) -> dict:
  """The counts of one loop body (`KINDS`, the asynchronous copies by size) and its most rows."""
  row = collections.Counter()
  rows = set()
  for line in lines:
    start = re.search(r'= \(\(.*\), \w+\[([\d,]*)\]\{[^}]*\}, u32\[\]\) async-start\(', line)
    if start:
      size = math.prod(int(d) for d in start.group(1).split(',') if d)
      row['copies, weight-sized' if size > big else 'copies, small'] += 1
    for column, pattern in KINDS:
      row[column] += bool(re.search(pattern, line))
    rows.update(int(r) for r in re.findall(rf'\[(\d+),{width}\]', line))
  return dict(row, rows=max(rows, default=0))


def loops(text: str, big: int, width: int) -> list[tuple[str, dict]]:
  """(while instruction, `body_row` of its body) for each `while` of the module, in text order."""
  comps = computations(text)
  out = []
  for line in text.splitlines():
    if ' while(' in line:
      name = re.search(r'(%while[\w.]*)', line).group(1)
      out.append((name, body_row(comps[re.search(r'body=(%[^ ,]+)', line).group(1)], big, width)))
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('paths', nargs='+', help="optimised modules' text (XLA's *after_optimizations.txt)")
  p.add_argument('--big', type=int, default=100_000, help='elements above which a copy is weight-sized')
  p.add_argument('--width', type=int, default=1280, help="the model's width, whose activations give the rows")
  args = p.parse_args()
  columns = ['copies, weight-sized', 'copies, small'] + [c for c, _ in KINDS]
  for path in args.paths:
    with open(path) as f:
      found = loops(f.read(), args.big, args.width)
    print(f'\n{path}\n\n| while | ' + ' | '.join(columns) + ' | most rows |')
    print('| --- ' * (len(columns) + 2) + '|')
    for name, row in found:
      print(f'| {name} | ' + ' | '.join(str(row.get(c, 0)) for c in columns) + f' | {row["rows"]} |')


if __name__ == '__main__':
  main()
