"""MAR sampling speed: MAR-B / MAR-H at 256 px, 64 iterations, 100 diffusion steps, cfg 3.0.

  python benchmarks/mar_sampling.py --sizes base,huge --batches 1,16

Random weights (official init), bf16 compute with float32 parameters, the
KL-16 decoder included. Compile time apart; medians over --iters calls after
--warmup calls, each with a fresh key. `--sizes tiny` runs on a CPU. Beside every time: the
memory floor (`floors.py`): the encoder and decoder weights read once per iteration, the
diffusion head's once per diffusion step of every iteration, the KL-16 decoder once, in the
compute dtype, at the HBM bandwidth a copy reaches in the same run; and the traffic floor, the
weights the program at that batch reads (the head's adaLN Linears once an iteration where its
adaLN outputs come ahead). `--adaln_ahead_rows 128,0`
compiles each sampler twice, side by side: the diffusion head's adaLN outputs of every step
computed before its loop up to 128 rows (`blocks.ADALN_AHEAD_MAX_ROWS`), and at every step;
`--encoder_sizes 4,0` likewise: the encoder on the known positions at up to 4 lengths, and on
every position; `--xla ';xla_gpu_enable_pdl=true'` likewise: XLA's defaults, then each set of
options.
"""
from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from sampling import compilation_cache
from configs import mar as mar_configs
import floors
from timing import print_top_device_ops, time_compiled, xla_variants
from var_models.mar import from_config as models
from var_models.mar.sampler import make_mar_sampler
from var_models.nn import blocks


def time_one(make_sampler, params, labels, ahead_rows: int, encoder_sizes, xla: dict, args, bound, bandwidth,
             **meta) -> dict:
  """Compiles (with XLA options `xla`) and times a new sampler's call on `labels` [B], the head's
  adaLN outputs computed ahead up to ahead_rows rows, the encoder at `encoder_sizes` lengths (a
  sampler of its own: each traces once)."""
  lab, cfg, temp = jnp.asarray(labels), jnp.float32(args.cfg), jnp.float32(1.0)
  blocks.ADALN_AHEAD_MAX_ROWS = ahead_rows   # read when the sampler is traced
  sample = make_sampler(encoder_sizes)
  traffic = floors.floor(floors.sampler_reads(sample, params, args.dtype, batch=len(labels)), bandwidth)
  compiled, row = time_compiled(sample.lower(params, jax.random.key(0), labels, cfg=args.cfg),
                                lambda i: (params, jax.random.key(i), lab, cfg, temp), len(labels), args.warmup,
                                args.iters, xla)
  row = dict(**meta, batch=len(labels), adaln_ahead_rows=ahead_rows, encoder_sizes=encoder_sizes, xla=xla,
             steps=args.steps, floor_ms=bound['seconds'] * 1e3, traffic_floor_ms=traffic['seconds'] * 1e3,
             bandwidth_gb_s=bandwidth / 1e9, **row)
  if args.profile:
    print_top_device_ops(lambda: jax.block_until_ready(compiled(params, jax.random.key(9), lab, cfg, temp)),
                         args.profile)
  print(f"MAR-{row['size']:5} B={row['batch']:<3} adaLN ahead <= {ahead_rows:3} rows, encoder lengths "
        f"{encoder_sizes or 'all'}{f' XLA {xla}' if xla else ''}: compile {row['compile_s']:6.1f} s  "
        f"median {row['median_ms']:9.1f} ms  per image {row['per_image_ms']:8.2f} ms  [{row['min_ms']:.1f}, "
        f"{row['max_ms']:.1f}]  {row['median_ms'] / row['floor_ms']:.2f}x the floor {row['floor_ms']:.1f} ms, "
        f"{row['median_ms'] / row['traffic_floor_ms']:.2f}x the traffic floor {row['traffic_floor_ms']:.1f} ms",
        flush=True)
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--sizes', default='base,huge')
  ap.add_argument('--batches', default='1,16')
  ap.add_argument('--num_iter', type=int, default=64)
  ap.add_argument('--steps', type=int, default=100, help='diffusion steps')
  ap.add_argument('--cfg', type=float, default=3.0)
  ap.add_argument('--dtype', default='bfloat16')
  ap.add_argument('--backend', default=None, help='attention backend (default: the config)')
  ap.add_argument('--warmup', type=int, default=2)
  ap.add_argument('--iters', type=int, default=10)
  ap.add_argument('--json', default=None)
  ap.add_argument('--profile', default='', help='trace one call into this folder; print the top kernels')
  ap.add_argument('--adaln_ahead_rows', default=str(blocks.ADALN_AHEAD_MAX_ROWS),
                  help="rows up to which the head's adaLN outputs are computed before its loop (0: never), "
                  'one run per value')
  ap.add_argument('--encoder_sizes', default='4',
                  help="the encoder's lengths compiled (0: every position at one length, as the sampling flag), "
                  'one run per value')
  ap.add_argument('--copy_bytes', type=int, default=1 << 31, help='size of the copy that measures HBM bandwidth')
  ap.add_argument('--xla', default='', help="';'-separated sets of XLA options ('a=1,b=true'), one run per set "
                  "('' is XLA's defaults)")
  args = compilation_cache.parse_args(ap)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  bandwidth = floors.hbm_bandwidth(args.copy_bytes)
  print(f'HBM bandwidth (a {args.copy_bytes / 2**30:g} GiB copy): {bandwidth / 1e9:.0f} GB/s', flush=True)
  rows = []
  for size in args.sizes.split(','):
    config = mar_configs.get_config(size)
    config.dtype = args.dtype
    config.attn_backend = args.backend or config.attn_backend
    mar_cfg, vae_cfg = models.mar_configs(config)
    params = models.init_mar_params(mar_cfg, vae_cfg, jax.random.key(0))
    num_iter = min(args.num_iter, mar_cfg.seq_len)
    make_sampler = lambda sizes: make_mar_sampler(mar_cfg, vae_cfg, num_iter=num_iter, guided=args.cfg != 1.0,
                                                  num_diffusion_steps=args.steps, encoder_sizes=sizes)
    bound = floors.floor(floors.sampler_reads(make_sampler(None), params, args.dtype), bandwidth)
    print(f'MAR-{size}: {floors.describe(bound, bandwidth)}', flush=True)
    for batch in [int(b) for b in args.batches.split(',')]:
      labels = np.arange(batch, dtype=np.int32) % mar_cfg.class_num
      for ahead_rows, sizes, xla in itertools.product([int(r) for r in args.adaln_ahead_rows.split(',')],
                                                      [int(v) or None for v in args.encoder_sizes.split(',')],
                                                      xla_variants(args.xla)):
        rows.append(time_one(make_sampler, params, labels, ahead_rows, sizes, xla, args, bound, bandwidth, size=size,
                             num_iter=num_iter))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=1)


if __name__ == '__main__':
  main()
