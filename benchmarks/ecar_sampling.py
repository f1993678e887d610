"""E-CAR sampling speed and FLOPs: S / B / L at 256 px, the paper's evaluation settings.

  python benchmarks/ecar_sampling.py --variants S,B,L --batches 1,16           # GPU, bf16, cudnn
  python benchmarks/ecar_sampling.py --variants tiny --batches 2 --steps 6 --iters 2 --dtype float32 --backend xla

Random weights (our init; the SDXL VAE random too: its cost does not depend on its
values), `prepare`d as a loader hands them (the denoisers' Dense layers in the compute dtype),
250 Euler steps in all (a third per stage), CFG with the doubled batch (scale 1.5), VAE
decoding included. Compile time is measured apart (lower +
compile); run times are medians over --iters calls after --warmup calls, each
with a fresh key, timed on the host after block_until_ready. FLOPs per image are
matmul FLOPs counted on the sampler's jaxpr (`ecar.sampling_flops`), with and
without the VAE decoder, beside the paper's Table 2 (1T / 3.2T / 5.8T for S / B / L, which
leaves the decoder out: configs/ecar.py). Beside every time: the memory floor (`floors.py`): the
AR's weights read once per stage, each stage's denoiser once per Euler step, the VAE decoder once,
in the compute dtype, at the HBM bandwidth a copy reaches in the same run; and the traffic floor,
the weights the program at that batch reads (a denoiser's condition projection, and its adaLN
Linears where its adaLN outputs come ahead, once a stage). `--adaln_ahead_rows 128,0`
compiles each sampler twice, side by side: each stage's adaLN outputs of every Euler step computed
before its loop where the stage's denoiser runs on up to 128 rows (`blocks.ADALN_AHEAD_MAX_ROWS`),
and at every step. `--chained_rows 128,0` likewise: the denoisers' blocks chained through
`pallas_kernels.residual_norm` up to 128 rows (`ecar.model.CHAINED_MAX_ROWS`), and each block whole.
"""
from __future__ import annotations

import argparse
import itertools
import json

import jax
import numpy as np

from sampling import compilation_cache
import ecar
from configs import ecar as ecar_configs
import floors
from timing import print_top_device_ops, time_compiled, xla_variants
from ecar import model as ecar_model
from var_models.nn import blocks

PAPER_TFLOPS = {'S': 1.0, 'B': 3.2, 'L': 5.8}  # Table 2, with CFG, 250 steps


def model_config(variant: str, dtype: str, backend: str):
  c = ecar_configs.get_config(variant)
  c.dtype, c.attn_backend = dtype, backend
  return ecar.ecar_config(c)


def time_sampler(cfg, params, vae, batch: int, steps: int, guidance: float, warmup: int, iters: int,
                 ahead_rows: int, chained_rows: int, xla: dict, profile: str = '') -> dict:
  """Compiles (with XLA options `xla`) and times a new sampler (each traces once), the adaLN
  outputs computed ahead up to ahead_rows rows, the blocks chained up to chained_rows; the row
  holds the bytes its program reads ('traffic_bytes', `floors.sampler_reads` at the batch)."""
  blocks.ADALN_AHEAD_MAX_ROWS = ahead_rows   # both read when the sampler is traced
  ecar_model.CHAINED_MAX_ROWS = chained_rows
  sample = ecar.make_sampler(cfg, num_steps=steps)
  labels = np.arange(batch, dtype=np.int32) % cfg.num_classes
  both = sample.prepare({'ecar': params, 'vae': vae})   # as a loader hands them (`sampling.from_config`)
  compiled, row = time_compiled(sample.lower(both, jax.random.key(0), labels, cfg=guidance),
                                lambda i: sample.arguments(both, jax.random.key(i), labels, cfg=guidance),
                                batch, warmup, iters, xla)
  if profile:
    print_top_device_ops(lambda: jax.block_until_ready(
        compiled(*sample.arguments(both, jax.random.key(7), labels, cfg=guidance))), profile)
  return dict(row, traffic_bytes=floors.floor(floors.sampler_reads(sample, both, cfg.dtype, batch), 1.0)['bytes'])


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--variants', default='S,B,L')
  ap.add_argument('--batches', default='1,16')
  ap.add_argument('--steps', type=int, default=250, help='Euler steps in all, split over the stages')
  ap.add_argument('--cfg', type=float, default=1.5)
  ap.add_argument('--dtype', default='bfloat16')
  ap.add_argument('--backend', default='cudnn', help="attention backends ('cudnn,xla'), one run per value")
  ap.add_argument('--warmup', type=int, default=3)
  ap.add_argument('--iters', type=int, default=10)
  ap.add_argument('--no_flops', action='store_true', help='skip the FLOP count (one more compile per variant)')
  ap.add_argument('--json', default=None, help='also write the rows here')
  ap.add_argument('--profile', default='', help='trace one call per shape into this folder; print the top kernels')
  ap.add_argument('--adaln_ahead_rows', default=str(blocks.ADALN_AHEAD_MAX_ROWS),
                  help="rows up to which a stage's adaLN outputs are computed before its loop (0: never), "
                  'one run per value')
  ap.add_argument('--chained_rows', default=str(ecar_model.CHAINED_MAX_ROWS),
                  help="rows up to which the denoisers' blocks run chained (0: never), one run per value")
  ap.add_argument('--xla', default='', help="';'-separated sets of XLA options ('a=1,b=true'), one run per set "
                  "('' is XLA's defaults)")
  ap.add_argument('--copy_bytes', type=int, default=1 << 31, help='size of the copy that measures HBM bandwidth')
  args = compilation_cache.parse_args(ap)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  bandwidth = floors.hbm_bandwidth(args.copy_bytes)
  print(f'HBM bandwidth (a {args.copy_bytes / 2**30:g} GiB copy): {bandwidth / 1e9:.0f} GB/s', flush=True)
  rows, backends = [], args.backend.split(',')
  for variant in args.variants.split(','):
    cfg = model_config(variant, args.dtype, backends[0])
    params = ecar.init_params(cfg, jax.random.key(0))
    vae = ecar.init_vae_params(cfg, jax.random.key(1))
    print(f'E-CAR-{variant}: {ecar.param_count(params) / 1e6:.1f}M params, stages {cfg.stage_sizes}, '
          f'tokens {cfg.stage_tokens}', flush=True)
    flops = None if args.no_flops else ecar.sampling_flops(cfg, num_steps=args.steps)
    if flops:
      paper = PAPER_TFLOPS.get(variant)
      print(f"  FLOPs per image: {flops['per_image'] / 1e9:.1f} G "
            f"({flops['per_image_without_decode'] / 1e9:.1f} G without the VAE decoder"
            f"{f'; paper {paper:g} T' if paper else ''}), steps per stage {flops['steps_per_stage']}", flush=True)
    bound = floors.floor(floors.sampler_reads(ecar.make_sampler(cfg, num_steps=args.steps),
                                              {'ecar': params, 'vae': vae}, args.dtype), bandwidth)
    print(f'  {floors.describe(bound, bandwidth)}', flush=True)
    for batch, backend, ahead_rows, chained_rows, xla in itertools.product(
        [int(b) for b in args.batches.split(',')], backends, [int(r) for r in args.adaln_ahead_rows.split(',')],
        [int(r) for r in args.chained_rows.split(',')], xla_variants(args.xla)):
      r = time_sampler(model_config(variant, args.dtype, backend), params, vae, batch, args.steps, args.cfg,
                       args.warmup, args.iters, ahead_rows, chained_rows, xla, args.profile)
      r.update(variant=variant, batch=batch, steps=args.steps, dtype=args.dtype, backend=backend,
               adaln_ahead_rows=ahead_rows, chained_rows=chained_rows, xla=xla,
               tflops_per_image=None if not flops else flops['per_image'] / 1e12,
               floor_ms=bound['seconds'] * 1e3, traffic_floor_ms=r['traffic_bytes'] / bandwidth * 1e3,
               bandwidth_gb_s=bandwidth / 1e9)
      rows.append(r)
      print(f"  B={batch:<3} {backend} attention, adaLN ahead <= {ahead_rows:3} rows, chained <= {chained_rows:3}"
            f"{f' XLA {xla}' if xla else ''}: "
            f"compile {r['compile_s']:6.1f} s  median {r['median_ms']:9.2f} ms  "
            f"per image {r['per_image_ms']:8.2f} ms  (min {r['min_ms']:.2f}, max {r['max_ms']:.2f})  "
            f"{r['median_ms'] / r['floor_ms']:.2f}x the floor {r['floor_ms']:.2f} ms, "
            f"{r['median_ms'] / r['traffic_floor_ms']:.2f}x the traffic floor {r['traffic_floor_ms']:.2f} ms",
            flush=True)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=2)


if __name__ == '__main__':
  main()
