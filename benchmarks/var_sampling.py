"""VAR sampling speed: d16 / d30 at 256 px, bf16 compute, attention backends side by side.

  python benchmarks/var_sampling.py --depths 16,30 --batches 1,16,64 --backends cudnn,xla

Random weights (official init), the paper's FID sampling settings (cfg 1.5,
top-k 900, top-p 0.96). Compile time is measured apart (lower + compile); run
times are medians over --iters calls after --warmup calls, each call with a
fresh key, timed on the host after block_until_ready.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from var_models.var import VARConfig
from var_models.var_sampler import make_sampler
from var_models.vqvae import VQVAEConfig
from train.models import init_var_params


def cast_var_params(params, dtype):
  """VAR weights stored in the compute dtype (what fp16 autocast reads); the VQVAE stays float32."""
  return {'var': jax.tree_util.tree_map(lambda p: p.astype(dtype), params['var']), 'vqvae': params['vqvae']}


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


def time_sampler(sample, params, batch: int, warmup: int, iters: int, hlo_stats: bool = False) -> dict:
  labels = np.arange(batch, dtype=np.int32) % 1000
  opts = dict(cfg=1.5, top_k=900, top_p=0.96)
  t0 = time.perf_counter()
  compiled = sample.lower(params, jax.random.key(0), labels, **opts).compile()
  compile_s = time.perf_counter() - t0
  lab, cfg = jnp.asarray(labels), jnp.float32(opts['cfg'])
  times = []
  for i in range(warmup + iters):
    key = jax.random.key(i)
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(params, key, lab, cfg))
    if i >= warmup:
      times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  if hlo_stats:
    print('  entry ops:', entry_op_counts(compiled), flush=True)
  return dict(compile_s=compile_s, median_ms=med * 1e3, per_image_ms=med * 1e3 / batch,
              min_ms=min(times) * 1e3, max_ms=max(times) * 1e3)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--depths', default='16,30')
  ap.add_argument('--batches', default='1,16,64')
  ap.add_argument('--backends', default='cudnn,xla')
  ap.add_argument('--param_dtypes', default='bfloat16', help='VAR weight storage: bfloat16 and/or float32')
  ap.add_argument('--warmup', type=int, default=3)
  ap.add_argument('--iters', type=int, default=20)
  ap.add_argument('--json', default=None, help='also write the rows here')
  ap.add_argument('--hlo_stats', action='store_true', help='print the compiled entry ops by kind')
  args = ap.parse_args()
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  rows = []
  for depth in [int(d) for d in args.depths.split(',')]:
    base = init_var_params(VARConfig(depth=depth), VQVAEConfig(), jax.random.key(depth))
    for pdt in args.param_dtypes.split(','):
      params = cast_var_params(base, jnp.dtype(pdt))
      for backend in args.backends.split(','):
        var_cfg = VARConfig(depth=depth, dtype=jnp.bfloat16, attn_backend=backend)
        sample = make_sampler(var_cfg, VQVAEConfig(dtype=jnp.bfloat16))
        for batch in [int(b) for b in args.batches.split(',')]:
          r = dict(depth=depth, backend=backend, param_dtype=pdt, batch=batch,
                   **time_sampler(sample, params, batch, args.warmup, args.iters, args.hlo_stats))
          rows.append(r)
          print(f"d{depth:<3} {backend:6} {pdt:9} B={batch:<3} compile {r['compile_s']:6.1f} s  "
                f"median {r['median_ms']:8.2f} ms  per image {r['per_image_ms']:7.3f} ms  "
                f"[{r['min_ms']:.2f}, {r['max_ms']:.2f}]", flush=True)
    del base
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=1)


if __name__ == '__main__':
  main()
