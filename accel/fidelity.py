"""The fidelity comparison behind `python -m accel.compare`: accelerated samplers against the baseline, on
the same keys and labels, as a library (no flags: runners and tests import it).

  table = compare(family, {spec: policy}, seeds, labels, batch, out, lpips_params, grid, workers)

Per image, PSNR, SSIM and LPIPS (given LPIPS params) of each accelerated image against the baseline's;
for VAR, per scale, the fraction of equal token ids; per sampler, the median latency of a call (after a
warm-up call), compile time and XLA's peak memory. The programs compile `workers` at a time (XLA runs
most of a compile on one thread, so side by side they overlap), then each sampler runs alone. Writes
summary.md, POLICY.json and POLICY.png under `out` (see accel/compare.py; POLICY is the spec as `file_name` writes it).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import statistics
from typing import Any, Optional

import jax
import numpy as np
from PIL import Image

from accel import metrics
from accel.timing import compile_in, timed_calls
from sampling import Family

@dataclasses.dataclass
class Run:
  """What one sampler produced over the seeds."""
  images: np.ndarray              # [N, H, W, 3] in [0, 1]
  indices: Optional[list]         # VAR: per scale it ran, [N, pn * pn]; else None
  latency_ms: float               # median call, after a warm-up call
  compile_s: float
  peak_bytes: Optional[int]       # XLA's buffer assignment; None where the backend gives none


def parse_seeds(text: str) -> list[int]:
  """'0-3,7' -> [0, 1, 2, 3, 7]."""
  seeds = []
  for part in text.split(','):
    lo, _, hi = part.strip().partition('-')
    try:
      first, last = int(lo), int(hi or lo)
    except ValueError:
      raise ValueError(f"--seeds must look like '0-63' or '0,5,9-12', got {text!r}") from None
    if first < 0 or last < first:
      raise ValueError(f'--seeds: bad range {part!r} in {text!r}')
    seeds.extend(range(first, last + 1))
  return seeds


def peak_bytes(compiled) -> Optional[int]:
  """Arguments + outputs + temporaries - aliased, from XLA's memory analysis of a compiled program."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


@dataclasses.dataclass
class _Job:
  """A sampler's program for one call of `batch` images and the calls that cover the seeds."""
  lowered: Any
  args: list                      # each call's checked arguments
  groups: list[slice]             # each call's seeds (the last call padded to `batch` and cut)


def _job(family: Family, policy, seeds: list[int], labels: np.ndarray, batch: int) -> _Job:
  sample = family.make(policy)
  groups = [slice(i, i + batch) for i in range(0, len(seeds), batch)]
  calls = [(jax.random.key(seeds[g.start]), np.resize(labels[g], batch).astype(np.int32)) for g in groups]
  args = [sample.arguments(family.params, *c, **family.opts) for c in calls]   # checked outside the timed calls
  return _Job(sample.lower(family.params, *calls[0], **family.opts), args, groups)


def _run(family: Family, job: _Job, compiled, compile_s: float, seeds: list[int]) -> Run:
  """The compiled job's calls, a warm-up call first, each timed alone."""
  images, indices, times = [], [], []
  for g, ((out, aux), seconds) in zip(job.groups, timed_calls(compiled, [job.args[0], *job.args], warmup=1)):
    times.append(seconds)
    n = len(seeds[g])
    images.append(np.asarray(out, np.float32)[:n])
    tokens = family.tokens(aux)
    indices.append(None if tokens is None else [np.asarray(i)[:n] for i in tokens])
  per_scale = None if indices[0] is None else [np.concatenate(s) for s in zip(*indices)]
  return Run(np.concatenate(images), per_scale, statistics.median(times) * 1e3, compile_s, peak_bytes(compiled))


def run_samplers(family: Family, policies: dict, seeds: list[int], labels: np.ndarray, batch: int,
                 workers: int) -> list[Run]:
  """Samples `seeds` (labels [N]) with each of {name: policy (None: the baseline)} in calls of `batch`
  images: every program lowered, compiled `workers` at a time, then each run alone, in order."""
  jobs = [_job(family, policy, seeds, labels, batch) for policy in policies.values()]
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    futures = [compile_in(pool, name, job.lowered) for name, job in zip(policies, jobs)]
    compiled = [f.result()[1] for f in futures]
  return [_run(family, job, *c, seeds) for job, c in zip(jobs, compiled)]


def save_pairs(base: np.ndarray, other: np.ndarray, path: str, ncol: int = 4) -> None:
  """PNG of [baseline | accelerated] pairs, ncol pairs a row, 4 px gaps."""
  n, h, w, _ = base.shape
  pairs = np.concatenate([base, np.ones((n, h, 4, 3)), other], axis=2)
  rows = -(-n // ncol)
  grid = np.ones((rows * (h + 4), ncol * (2 * w + 12), 3))
  for i, p in enumerate(pairs):
    r, c = divmod(i, ncol)
    grid[r * (h + 4):r * (h + 4) + h, c * (2 * w + 12):c * (2 * w + 12) + p.shape[1]] = p
  Image.fromarray((np.clip(grid, 0, 1) * 255 + 0.5).astype(np.uint8)).save(path)


def _mib(b: Optional[int]) -> str:
  return '-' if b is None else f'{b / 2 ** 20:.0f}'


def table_row(spec: str, base: Run, acc: Run, m: dict) -> str:
  """One markdown row: fidelity (means; PSNR over the images that differ), speed and memory."""
  finite = m['psnr'][np.isfinite(m['psnr'])]
  psnr = f'{finite.mean():.2f}' if finite.size else 'inf'
  lp = '-' if m['lpips'] is None else f"{np.mean(m['lpips']):.4f}"
  agree = '-' if m['agreement'] is None else ' '.join(f'{a:.3f}' for a in m['agreement'])
  return (f"| {spec} | {len(acc.images)} | {int(np.sum(~np.isfinite(m['psnr'])))} | {psnr} | "
          f"{np.mean(m['ssim']):.4f} | {lp} | {agree} | {base.latency_ms:.2f} | {acc.latency_ms:.2f} | "
          f'{base.latency_ms / acc.latency_ms:.2f}x | {_mib(base.peak_bytes)} | {_mib(acc.peak_bytes)} | '
          f'{base.compile_s:.1f} / {acc.compile_s:.1f} |')


TABLE_HEAD = ('| policy | images | identical | PSNR dB (others) | SSIM | LPIPS | token agreement per scale | '
              'baseline ms | accelerated ms | speed-up | baseline peak MiB | accelerated peak MiB | '
              'compile s (base / acc) |\n' + '| --- ' * 13 + '|')


def file_name(spec: str) -> str:
  """A policy spec as a file name without characters a shell reads: 'fastvar:infinity_2b[blocks=(3, 4)]' ->
  'fastvar_infinity_2b_blocks=_3_4', 'a+b' -> 'a__b'."""
  return re.sub(r'[^\w.=-]+', '_', spec.replace('+', '__')).strip('_')


def compare(family: Family, policies: dict, seeds: list[int], labels: np.ndarray, batch: int, out: str,
            lpips_params=None, grid: int = 16, workers: int = 4) -> str:
  """Runs the baseline and each policy (their programs compiled `workers` at a time); writes
  summary.md, NAME.json, NAME.png; returns the table."""
  os.makedirs(out, exist_ok=True)
  base, *runs = run_samplers(family, {'the baseline': None, **policies}, seeds, labels, batch, workers)
  rows = [TABLE_HEAD]
  for spec, acc in zip(policies, runs):
    m = metrics.summarise(base.images, acc.images, lpips_params)
    m['agreement'] = None if base.indices is None else metrics.token_agreement(base.indices, acc.indices)
    name = file_name(spec)
    save_pairs(base.images[:grid], acc.images[:grid], os.path.join(out, f'{name}.png'))
    record = {'policy': spec, 'seeds': seeds, 'labels': labels.tolist(), 'options': family.options, 'batch': batch,
              **{k: (None if v is None else np.asarray(v).tolist()) for k, v in m.items()},
              **{f'{who}_{k}': getattr(r, k) for who, r in (('baseline', base), ('accelerated', acc))
                 for k in ('latency_ms', 'compile_s', 'peak_bytes')}}
    with open(os.path.join(out, f'{name}.json'), 'w') as f:
      json.dump(record, f, indent=1, allow_nan=True)
    rows.append(table_row(spec, base, acc, m))
  table = '\n'.join(rows)
  with open(os.path.join(out, 'summary.md'), 'w') as f:
    f.write(table + '\n')
  return table
