"""How long a sampler takes to its first image in a fresh process, phase by phase: Python's
tracing and lowering, XLA's compile, the first call and a later one.

  python3 benchmarks/first_image.py --model infinity_2b --sampler baseline@scan --compilation_cache=
  python3 benchmarks/first_image.py --model infinity_2b --sampler fastvar:infinity_2b --compilation_cache=   # unrolled
  python3 benchmarks/first_image.py --family mar:huge --sampler lazymar:official --compilation_cache=
  python3 benchmarks/first_image.py --family mar:huge --sampler lazymar:official --overrides host_loop=true
  python benchmarks/first_image.py --model smoke --sampler fastvar:var256@scan --attn xla     # on a CPU

--model names a VAR of `accelerators.MODELS`; --family 'mar:SIZE' or 'ecar:SIZE' a config of
configs/mar.py or configs/ecar.py instead, sampled as `accelerators.py --mar_sizes / --ecar_sizes`
sample it (`FAMILY_OVERRIDES`, bf16 compute, random weights).

One sampler per process (`accelerators.sampler_names` spells it: a policy spec, '@scan' for its blocks
as a scan), so nothing compiled earlier in the process (XLA's in-process autotuning results
included) shortens its compile: the figures are what a researcher's first command waits. A scanned
sampler compiles with its own XLA options (`var_models.nn.blocks.CUBLAS_GEMMS`). With the
persistent compilation cache on (the default), a second run of the same command loads the program
and XLA's autotuning results from it; --compilation_cache= measures a cold start.
"""
from __future__ import annotations

import argparse
import time

import jax

from accel.timing import compiled_in
from accelerators import MODELS, build, family_config, family_job, family_layouts, layouts, sampler_job
from sampling import compilation_cache
from timing import settings


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--model', default='infinity_2b', choices=sorted(MODELS))
  ap.add_argument('--sampler', default='baseline@scan', help="a policy spec or 'baseline', '@scan' for scanned blocks")
  ap.add_argument('--batch', type=int, default=1)
  ap.add_argument('--family', default='', help="'mar:SIZE' or 'ecar:SIZE': that config's sampler instead of --model")
  ap.add_argument('--attn', default='cudnn')
  ap.add_argument('--overrides', default='', help="--family's sampling settings "
                  "('key=value,...', e.g. 'host_loop=true')")
  args = compilation_cache.parse_args(ap)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  t0 = time.perf_counter()
  scan = 'on' if args.sampler.partition('@')[2] else 'off'
  if args.family:
    config = family_config(*args.family.split(':'), 'bfloat16', args.attn)
    family, makes, params = family_layouts(config, scan, settings(args.overrides))
    job = lambda: family_job(family, makes, params, args.sampler, args.batch)[1:]
  else:
    spec = args.sampler.partition('@')[0]
    var_cfg, vq_cfg, params, _ = build(args.model, args.attn, '' if spec == 'baseline' else spec)
    params = layouts(var_cfg, vq_cfg, params, scan)
    job = lambda: sampler_job(var_cfg, vq_cfg, params, args.sampler, args.batch)
  jax.block_until_ready(params)
  t1 = time.perf_counter()
  lowered, make_args = job()   # (lowered sampler, args maker)
  t2 = time.perf_counter()
  compiled, compile_s = compiled_in(lowered)
  t3 = time.perf_counter()
  jax.block_until_ready(compiled(*make_args(0)))
  t4 = time.perf_counter()
  jax.block_until_ready(compiled(*make_args(1)))
  t5 = time.perf_counter()
  print(f'{args.family or args.model} B={args.batch} {args.sampler}: parameters {t1 - t0:.1f} s, '
        f'trace and lower {t2 - t1:.1f} s, XLA compile {compile_s:.1f} s, first call {t4 - t3:.2f} s (to the first '
        f'image from the sampler\'s construction: {t4 - t1:.1f} s), a later call {1e3 * (t5 - t4):.1f} ms', flush=True)


if __name__ == '__main__':
  main()
