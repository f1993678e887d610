"""Timing compiled samplers: compile apart, median of host-timed calls after warm-up."""
from __future__ import annotations

import bisect
import collections
import glob
import gzip
import json
import re
import statistics
import time
from typing import Callable

import jax

from accel.timing import compiled_in, timed_calls


def settings(spec: str) -> dict:
  """'a=1,b=true,c=x,y' -> {'a': 1, 'b': True, 'c': 'x,y'}: a comma starts a setting only before
  'name=', so a list value (XLA's 'xla_gpu_enable_command_buffer=FUSION,CUBLAS') stays whole;
  values are read as JSON where they parse."""
  def value(text):
    try:
      return json.loads(text)
    except json.JSONDecodeError:
      return text
  return {k: value(v) for k, v in (kv.split('=', 1) for kv in re.split(r',(?=\w+=)', spec) if kv)}


def xla_variants(spec: str) -> list[dict]:
  """'a=1,b=true;c=x' -> [{'a': 1, 'b': True}, {'c': 'x'}]: one dict of XLA compiler
  options per ';'-separated variant ('' is XLA's defaults)."""
  return [settings(variant) for variant in spec.split(';')]


def time_compiled(lowered, make_args: Callable[[int], tuple], batch: int, warmup: int, iters: int,
                  compiler_options: dict | None = None):
  """Compiles `lowered` (with XLA `compiler_options`), then times calls with make_args(i)
  (fresh keys per call).

  Returns (compiled, row) with compile seconds and median / min / max milliseconds.
  """
  compiled, compile_s = compiled_in(lowered, compiler_options)
  times = call_times(compiled, make_args, warmup, iters)
  med = statistics.median(times)
  return compiled, dict(compile_s=compile_s, median_ms=med * 1e3, per_image_ms=med * 1e3 / batch,
                        min_ms=min(times) * 1e3, max_ms=max(times) * 1e3)


def call_times(compiled, make_args: Callable[[int], tuple], warmup: int, iters: int) -> list[float]:
  """Seconds of each of `iters` calls compiled(*make_args(i)) after `warmup` calls, each timed on
  the host after block_until_ready (`accel.timing.timed_calls`)."""
  calls = map(make_args, range(warmup + iters))
  return [seconds for _, seconds in timed_calls(compiled, calls, warmup)]


def step_times(call: Callable[[], object], warmup: int, iters: int) -> tuple[dict, object]:
  """(milliseconds, the last call's output) of a step that call() dispatches and returns what to
  wait for. Milliseconds three ways:
  'synced', the median of `iters` calls each waited for (after `warmup`); 'dispatch', the median
  time those calls took to return (the host's work before the device runs the step); 'back_to_back',
  the mean of `iters` calls each dispatched before the last one ends, as a training loop runs them."""
  synced, dispatch = [], []
  for i in range(warmup + iters):
    t0 = time.perf_counter()
    out = call()
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    if i >= warmup:
      synced.append(time.perf_counter() - t0)
      dispatch.append(t1 - t0)
  t0 = time.perf_counter()
  for _ in range(iters):
    out = call()
  jax.block_until_ready(out)
  return dict(synced=statistics.median(synced) * 1e3, dispatch=statistics.median(dispatch) * 1e3,
              back_to_back=(time.perf_counter() - t0) / iters * 1e3), out


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


def trace_events(run: Callable[[], None], logdir: str) -> dict[str, list[tuple[str, str, float, float]]]:
  """Traces run() with the JAX profiler -> {'device': events, 'host': events}, each event
  (line, name, start us, duration us) of the Perfetto trace in time order, on one clock. Device
  lines are XLA ops and kernels per stream (each line a separate view of the same work); host
  lines are the threads of the processes that launch them (Python, PjRt's execute, XLA's thunks)."""
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    run()
  path = sorted(glob.glob(f'{glob.escape(logdir)}/**/*.trace.json.gz', recursive=True))[-1]   # a spec's [...]
  with gzip.open(path) as f:
    events = json.load(f)['traceEvents']
  meta = lambda kind: {(e['pid'], e.get('tid')) if kind == 'thread_name' else e['pid']: e['args']['name']
                       for e in events if e.get('ph') == 'M' and e.get('name') == kind}
  processes, threads = meta('process_name'), meta('thread_name')
  device = {pid for pid, name in processes.items() if 'GPU' in name or 'device:' in name}
  out = {'device': [], 'host': []}
  for e in events:
    if e.get('ph') == 'X':
      line = threads.get((e['pid'], e.get('tid')), str(e.get('tid')))
      out['device' if e.get('pid') in device else 'host'].append((line, e['name'], e.get('ts', 0.0), e.get('dur', 0.0)))
  return {k: sorted(v, key=lambda e: e[2]) for k, v in out.items()}


def top_ops(events, top: int = 25):
  """`trace_events(...)['device']` -> ([(line, op name, total ms, count)] of the `top` ops by time, {line: busy ms}).
  A Pallas kernel's call sites (`name__3`, `name__5`, ...) count as one op."""
  total, count, busy = collections.Counter(), collections.Counter(), collections.Counter()
  for line, name, _, dur in events:
    name = _op_name(name)
    total[line, name] += dur / 1e3
    count[line, name] += 1
    busy[line] += dur / 1e3
  return [(line, name, ms, count[line, name]) for (line, name), ms in total.most_common(top)], dict(busy)


def _op_name(name: str) -> str:
  """A kernel's name with a Pallas call site's suffix (`name__3`) dropped: its call sites are one op."""
  return re.sub(r'__\d+$', '', name)


def _stream_gaps(events) -> tuple[float, list[tuple[float, float, str, str]]]:
  """`trace_events(...)['device']` -> (span us, [(start, end, kernel before, kernel after)] of every
  time no kernel runs on any stream), each gap named by the kernel that ended last before it and
  the one that ends it. Only the 'Stream' lines count: the others view the same work as XLA ops,
  which span the gaps inside a loop or a conditional."""
  kernels = sorted((ts, ts + d, _op_name(n)) for line, n, ts, d in events if 'Stream' in line)
  if not kernels:
    return 0.0, []
  gaps, (_, end, last) = [], kernels[0]
  for start, stop, name in kernels[1:]:
    if start > end:
      gaps.append((end, start, last, name))
    if stop > end:
      end, last = stop, name
  return end - kernels[0][0], gaps


def device_gaps(events, min_gap_us: float = 5.0) -> tuple[float, list[tuple[float, float]]]:
  """`trace_events(...)['device']` -> (span us, [(start, end) us] of every gap of at least `min_gap_us` when no
  kernel runs on any stream, `_stream_gaps`)."""
  span, gaps = _stream_gaps(events)
  return span, [(a, b) for a, b, _, _ in gaps if b - a >= min_gap_us]


def gaps_by_neighbours(events, lo_us: float, hi_us: float = float('inf')) -> dict:
  """`trace_events(...)['device']` -> {(kernel before, kernel after): (count, total us)} over the
  gaps of [lo_us, hi_us) when no kernel runs on any stream (`_stream_gaps`). Says which launches
  wait: a memset before every cuDNN call, a program's first kernel after its host-side launch, a
  conditional's read-back."""
  out = collections.defaultdict(lambda: [0, 0.0])
  for a, b, before, after in _stream_gaps(events)[1]:
    if lo_us <= b - a < hi_us:
      out[before, after][0] += 1
      out[before, after][1] += b - a
  return {pair: tuple(v) for pair, v in out.items()}


def host_events_under(host, gaps, longest_us: float) -> collections.Counter:
  """{host event name: how many of `gaps` (disjoint, in time order) it overlaps}, over the host
  events (`trace_events(...)['host']`) shorter than `longest_us` (not the call's enclosing spans).
  One bisection per event, so a trace of a million events takes seconds."""
  starts, ends = [a for a, _ in gaps], [b for _, b in gaps]
  under = collections.Counter()
  for _, name, ts, d in host:
    # the gaps (a, b) with a < ts + d and b > ts
    n = bisect.bisect_left(starts, ts + d) - bisect.bisect_right(ends, ts) if d < longest_us else 0
    if n > 0:
      under[name[:60]] += n
  return under


def overlapping_kernels(events) -> tuple[float, dict]:
  """`trace_events(...)['device']` -> (us when two or more kernels ran at once, {(kernel, kernel):
  us they overlapped}) over the 'Stream' lines (`_stream_gaps`): where a program's kernels ran
  concurrently, on streams of their own or as parallel nodes of one CUDA graph."""
  kernels = sorted((ts, ts + d, _op_name(n)) for line, n, ts, d in events if 'Stream' in line)
  pairs, active, multi, last = collections.Counter(), [], 0.0, None
  for start, stop, name in kernels:
    active = [(e, n) for e, n in active if e > start]
    for end, other in active:
      pairs[tuple(sorted((other, name)))] += min(end, stop) - start
    active.append((stop, name))
  points = sorted([(a, 1) for a, _, _ in kernels] + [(b, -1) for _, b, _ in kernels])
  depth = 0
  for t, step in points:
    if depth >= 2:
      multi += t - last
    depth, last = depth + step, t
  return multi, dict(pairs)


def device_gap_summary(events: dict, top: int = 8) -> str:
  """How long the GPU sat idle inside the traced call (`trace_events`), and the host events most
  often under its 200 longest gaps (what the GPU waited for: a conditional's read-back, a loop's
  launch, ...), and the kernels around the short and the long gaps that cost most
  (`gaps_by_neighbours`)."""
  span, gaps = device_gaps(events['device'])
  idle = sum(b - a for a, b in gaps)
  longest = sorted(sorted(gaps, key=lambda g: g[1] - g[0], reverse=True)[:200])
  under = host_events_under(events['host'], longest, span / 2)
  around = lambda lo, hi: ', '.join(
      f'{a[:28]} > {b[:28]} x{n} {us / 1e3:.2f} ms' for (a, b), (n, us) in
      sorted(gaps_by_neighbours(events['device'], lo, hi).items(), key=lambda kv: -kv[1][1])[:4])
  every_gap = sum(b - a for a, b, _, _ in _stream_gaps(events['device'])[1])
  multi, pairs = overlapping_kernels(events['device'])
  overlaps = ', '.join(f'{a[:28]} | {b[:28]} {us / 1e3:.2f} ms' for (a, b), us in
                       sorted(pairs.items(), key=lambda kv: -kv[1])[:top])
  return (f'  device idle {idle / 1e3:.2f} ms of a {span / 1e3:.2f} ms span ({len(gaps)} gaps >= 5 us; all gaps '
          f'{every_gap / 1e3:.2f} ms); host events under the {len(longest)} longest: {under.most_common(top)}\n'
          f'  two or more kernels at once {multi / 1e3:.2f} ms; the pairs overlapping longest: {overlaps}\n'
          f'  gaps of 2-20 us, by the kernels before > after them: {around(2.0, 20.0)}\n'
          f'  gaps of >= 20 us, by the kernels before > after them: {around(20.0, float("inf"))}')


def print_top_device_ops(run: Callable[[], None], logdir: str, top: int = 30) -> None:
  """Traces run() (see `trace_events`) and prints each device line's busy time and its time by
  kernel kind (`kernel_class`), the top ops and the device's idle gaps (`device_gap_summary`)."""
  events = trace_events(run, logdir)
  ops, busy = top_ops(events['device'], top)
  print(f'  device lines, busy ms in one call: {busy}', flush=True)
  for line, (_, _, by_class, _) in line_splits(events['device']).items():
    print(f'  [{line[:20]}] by kind, ms: ' + ', '.join(f'{c} {ms:.2f}' for c, ms in by_class.most_common()), flush=True)
  for line, name, ms, n in ops:
    print(f'  {ms:8.2f} ms  x{n:<6} [{line[:20]}] {name[:100]}', flush=True)
  print(device_gap_summary(events), flush=True)


# Kernel classes by name, first match wins: cuDNN / Pallas attention (with cuDNN's dO.O pre-pass of
# its backward), convolutions (not XLA's `convert` fusions, which are casts), GEMMs (cuBLAS,
# CUTLASS, Triton, Mosaic GPU: the only Mosaic kernels outside attention are GEMM-shaped; the
# Pallas `layer_dense`), NCCL
# collectives, then XLA's own fusions by their kind (reductions: norms, loss, softmax; copies and
# transposes; the rest elementwise).
KERNEL_CLASSES = (
    ('attention', ('sdpa', 'flash', 'fmha', 'attention', 'dot_do_o')),
    ('conv', ('fprop', 'dgrad', 'wgrad', 'implicit', 'convolution', 'convolve')),
    ('gemm', ('gemm', 'nvjet', 'xmma', 'cutlass', 'mosaic', 'matmul', 'dot', 'layer_dense')),
    ('collective', ('nccl', 'all-reduce', 'all_reduce', 'allreduce', 'all-gather', 'reduce-scatter')),
    ('reduce', ('reduce', 'scatter')),
    ('copy', ('copy', 'transpose', 'memcpy', 'memset', 'dynamic_update_slice', 'concatenate')),
)


def kernel_class(name: str) -> str:
  """A kernel's class (KERNEL_CLASSES) by its name; 'elementwise' for the rest."""
  n = name.lower()
  return next((cls for cls, keys in KERNEL_CLASSES if any(k in n for k in keys)), 'elementwise')


def line_splits(events) -> dict:
  """`trace_events(...)['device']` -> {line: (busy ms, span ms, {class: ms}, {kernel name: ms})}."""
  lines = collections.defaultdict(list)
  for line, name, ts, dur in events:
    lines[line].append((name, ts, dur))
  out = {}
  for line, evs in lines.items():
    by_class, by_name = collections.Counter(), collections.Counter()
    for name, _, dur in evs:
      by_class[kernel_class(name)] += dur / 1e3
      by_name[name[:90]] += dur / 1e3
    span = (max(ts + d for _, ts, d in evs) - min(ts for _, ts, _ in evs)) / 1e3
    out[line] = (sum(by_class.values()), span, by_class, by_name)
  return out

