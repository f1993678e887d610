"""The fidelity runner: accelerated next-scale samplers against the baseline, on the same keys.

  python -m accel.compare --config configs/var.py:small256 --ckpt runs/small256 \
      --policy fastvar:var256 --seeds 0-63 [--lpips ckpt/lpips] [--out compare/small256]

Any checkpoint `python -m train.sample` loads (`python -m var_models.convert var` output, or a
training workdir); without --ckpt the weights are random, which shows speed only. Seed s
samples with key(s) (with --batch_size b > 1, each group of b seeds shares the key of its
first) and label --labels[i % n] (default: s mod num_classes). The baseline and every --policy
(comma separated; 'a+b' composes) run on the same keys and labels; per image, PSNR, SSIM and
LPIPS (with --lpips, a `python -m var_models.convert lpips` directory) of the accelerated
image against the baseline's; per scale, the fraction of equal token ids; per sampler, the
median latency of a call (after a warm-up call), compile time and XLA's peak memory
(weights + temporaries + outputs of the compiled program). Writes, under --out,
summary.md (one row per policy, also printed), POLICY.json (every per-image figure) and
POLICY.png (baseline | accelerated pairs, the first --grid images).
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags
from PIL import Image

from accel import metrics
from accel.specs import policy_from_spec
from var_models.nn.checks import check_labels
from var_models.var.from_config import init_var_params, load_var_params, var_configs
from var_models.var.policy import ScalePolicy
from var_models.var.sampler import check_sample_args, make_sampler

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/var.py:VARIANT', lock_config=True)
_CKPT = flags.DEFINE_string('ckpt', None, 'checkpoint directory; none = random weights (speed only)')
_POLICY = flags.DEFINE_list('policy', ['fastvar:var256'], "policies, e.g. fastvar:infinity_2b ('a+b' composes)")
_SEEDS = flags.DEFINE_string('seeds', '0-15', "seeds, e.g. '0-63' or '0,5,9-12'")
_LABELS = flags.DEFINE_list('labels', None, 'class labels, cycled over the seeds (default: seed mod classes)')
_CFG = flags.DEFINE_float('cfg', None, 'guidance scale (default: config.sample.cfg)')
_TOP_K = flags.DEFINE_integer('top_k', None, 'top-k, 0 = off (default: config.sample.top_k)')
_TOP_P = flags.DEFINE_float('top_p', None, 'top-p in (0, 1] (default: config.sample.top_p)')
_BATCH = flags.DEFINE_integer('batch_size', 1, 'images per sampler call')
_LPIPS = flags.DEFINE_string('lpips', None, 'LPIPS params directory (python -m var_models.convert lpips)')
_OUT = flags.DEFINE_string('out', 'compare', 'output directory')
_GRID = flags.DEFINE_integer('grid', 16, 'image pairs in each PNG grid')


@dataclasses.dataclass
class Run:
  """What one sampler produced over the seeds."""
  images: np.ndarray              # [N, H, W, 3] in [0, 1]
  indices: list[np.ndarray]       # per scale it ran, [N, pn * pn]
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


def run_sampler(sample, params, seeds: list[int], labels: np.ndarray, batch: int, opts: dict) -> Run:
  """Samples `seeds` (labels [N]) in calls of `batch` images; the last call padded and cut."""
  groups = [slice(i, i + batch) for i in range(0, len(seeds), batch)]
  args = [(jax.random.key(seeds[g.start]), jnp.asarray(np.resize(labels[g], batch), jnp.int32)) for g in groups]
  t0 = time.perf_counter()
  compiled = sample.lower(params, args[0][0], np.asarray(args[0][1]), **opts).compile()
  compile_s = time.perf_counter() - t0
  cfg = jnp.float32(opts['cfg'])
  jax.block_until_ready(compiled(params, *args[0], cfg))
  images, indices, times = [], [], []
  for g, (key, lab) in zip(groups, args):
    t0 = time.perf_counter()
    out, aux = jax.block_until_ready(compiled(params, key, lab, cfg))
    times.append(time.perf_counter() - t0)
    n = len(seeds[g])
    images.append(np.asarray(out, np.float32)[:n])
    indices.append([np.asarray(i)[:n] for i in aux['indices']])
  return Run(np.concatenate(images), [np.concatenate(s) for s in zip(*indices)],
             statistics.median(times) * 1e3, compile_s, peak_bytes(compiled))


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
  agree = ' '.join(f'{a:.3f}' for a in m['agreement'])
  return (f"| {spec} | {len(acc.images)} | {int(np.sum(~np.isfinite(m['psnr'])))} | {psnr} | "
          f"{np.mean(m['ssim']):.4f} | {lp} | {agree} | {base.latency_ms:.2f} | {acc.latency_ms:.2f} | "
          f'{base.latency_ms / acc.latency_ms:.2f}x | {_mib(base.peak_bytes)} | {_mib(acc.peak_bytes)} | '
          f'{base.compile_s:.1f} / {acc.compile_s:.1f} |')


TABLE_HEAD = ('| policy | images | identical | PSNR dB (others) | SSIM | LPIPS | token agreement per scale | '
              'baseline ms | accelerated ms | speed-up | baseline peak MiB | accelerated peak MiB | '
              'compile s (base / acc) |\n' + '| --- ' * 13 + '|')


def compare(var_cfg, vq_cfg, params, policies: dict[str, ScalePolicy], seeds: list[int], labels: np.ndarray,
            opts: dict, batch: int, out: str, lpips_params=None, grid: int = 16) -> str:
  """Runs the baseline and each policy; writes summary.md, NAME.json, NAME.png; returns the table."""
  os.makedirs(out, exist_ok=True)
  base = run_sampler(make_sampler(var_cfg, vq_cfg), params, seeds, labels, batch, opts)
  rows = [TABLE_HEAD]
  for spec, policy in policies.items():
    acc = run_sampler(make_sampler(var_cfg, vq_cfg, policy), params, seeds, labels, batch, opts)
    m = metrics.summarise(base.images, acc.images, lpips_params)
    m['agreement'] = metrics.token_agreement(base.indices, acc.indices)
    name = spec.replace(':', '_').replace('+', '__')
    save_pairs(base.images[:grid], acc.images[:grid], os.path.join(out, f'{name}.png'))
    record = {'policy': spec, 'seeds': seeds, 'labels': labels.tolist(), 'options': opts, 'batch': batch,
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


def _labels(seeds: list[int], num_classes: int) -> np.ndarray:
  if _LABELS.value:
    try:
      pool = [int(x) for x in _LABELS.value]
    except ValueError:
      raise ValueError(f'--labels must be integers, got {_LABELS.value}') from None
    labels = np.array([pool[i % len(pool)] for i in range(len(seeds))], np.int32)
  else:
    labels = np.array(seeds, np.int32) % num_classes
  check_labels(labels, num_classes)
  return labels


def main(argv):
  del argv
  config = _CONFIG.value
  if config.family != 'var':
    raise ValueError(f'accel.compare runs next-scale (VAR) configs, got config.family={config.family!r}')
  var_cfg, vq_cfg = var_configs(config)
  s = config.sample
  pick = lambda flag, default: default if flag.value is None else flag.value
  opts = dict(cfg=pick(_CFG, s.cfg), top_k=pick(_TOP_K, s.top_k), top_p=pick(_TOP_P, s.top_p))
  check_sample_args(var_cfg, np.zeros(1, np.int32), **opts)
  if _BATCH.value <= 0:
    raise ValueError(f'--batch_size must be positive, got {_BATCH.value}')
  seeds = parse_seeds(_SEEDS.value)
  labels = _labels(seeds, var_cfg.num_classes)
  policies = {spec: policy_from_spec(spec) for spec in _POLICY.value}
  for spec, policy in policies.items():   # settings that do not fit the model fail here, before compiling
    policy.bind(var_cfg.schedule, var_cfg.depth)
  lpips_params = metrics.load_lpips(_LPIPS.value) if _LPIPS.value else None
  params = (load_var_params(var_cfg, vq_cfg, _CKPT.value) if _CKPT.value
            else init_var_params(var_cfg, vq_cfg, jax.random.key(0)))
  print(f'device: {jax.devices()[0].device_kind}; {len(seeds)} images, batch {_BATCH.value}, {opts}', flush=True)
  print(compare(var_cfg, vq_cfg, params, policies, seeds, labels, opts, _BATCH.value, _OUT.value, lpips_params,
                _GRID.value))


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
