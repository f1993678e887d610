"""A chain of skinny GEMMs, as in a batch-1 denoiser step: XLA's against
`pallas_kernels.skinny_dense_mgpu`'s kernels, whose weights load while the kernel before them runs
(programmatic dependent launch), with and without that head start; one process, Hopper.

  python3 benchmarks/skinny_chain.py --rows 8,16,28 --width 1536 --length 48 --matrices 24 \
    --xla ';xla_gpu_enable_pdl=true;xla_gpu_enable_command_buffer=' --profile /tmp/skinny

Each chain: h <- act(h) @ W[i % matrices] for i < length, act alternating identity and SiLU (an
MLP's two GEMMs), W [width, width] bf16, `matrices` distinct (24 of MAR-H's 4.7 MB: 113 MB, more
than the L2 holds, so each GEMM reads HBM). XLA's rows are [R, width] rounded to bf16 before each
GEMM, float32 products; the kernels pass float32 partial sums. Medians of --iters calls after
--warmup; us per GEMM beside the floor (a matrix's bytes at the bandwidth a device copy reaches in
the same run), and each chain's relative error against float32. --xla: every chain compiled again
under each set of options (XLA's PDL for its own fusions; command buffers off, where the kernels'
launches reach the stream with their dependent-launch attribute rather than inside a CUDA graph).
--profile: one traced call of each chain, its kernels' device time and the device's idle gaps (a
chain bound by its launches shows them).
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import floors
from pallas_kernels import skinny_dense_mgpu as sk
from sampling import compilation_cache
from timing import call_times, print_top_device_ops, xla_variants

ACTS = ('none', 'silu')


def xla_chain(h, ws, length: int):
  """h [R, C] float32 through `length` GEMMs of ws (a tuple of [C, C] bf16), XLA's."""
  for i in range(length):
    x = sk.ACTIVATIONS[ACTS[i % 2]](h).astype(ws[0].dtype)
    h = jnp.dot(x, ws[i % len(ws)], preferred_element_type=jnp.float32)
  return h


def kernel_chain(h, ws, length: int, num_sms: int, pdl: bool):
  """The same chain on the kernels: rows transposed and padded to 16 or 32, partial sums between."""
  r = h.shape[0]
  rp = 16 if r <= 16 else 32
  p = jnp.pad(h.T, ((0, 0), (0, rp - r)))[None]
  for i in range(length):
    p = sk.skinny_dense(p, ws[i % len(ws)], activation=ACTS[i % 2], num_sms=num_sms, pdl=pdl)
  return p.sum(0)[:, :r].T


def float32_chain(h, ws, length: int):
  for i in range(length):
    h = sk.ACTIVATIONS[ACTS[i % 2]](h) @ ws[i % len(ws)].astype(jnp.float32)
  return h


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--rows', default='8,16,28')
  ap.add_argument('--width', type=int, default=1536)
  ap.add_argument('--length', type=int, default=48, help='GEMMs in a chain')
  ap.add_argument('--matrices', type=int, default=24, help='distinct weight matrices, cycled')
  ap.add_argument('--warmup', type=int, default=3)
  ap.add_argument('--iters', type=int, default=15)
  ap.add_argument('--xla', default='', help="';'-separated sets of XLA options ('a=1,b=true'), every chain "
                  "compiled under each ('' is XLA's defaults)")
  ap.add_argument('--profile', default='', help='trace one call of each chain under this folder')
  args = compilation_cache.parse_args(ap)
  num_sms = jax.devices()[0].core_count
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {num_sms} SMs', flush=True)
  bandwidth = floors.hbm_bandwidth()
  c = args.width
  keys = jax.random.split(jax.random.key(0), args.matrices + 1)
  ws = tuple((jax.random.normal(k, (c, c)) / np.sqrt(c)).astype(jnp.bfloat16) for k in keys[1:])
  floor_us = c * c * 2 / bandwidth * 1e6
  print(f'HBM bandwidth {bandwidth / 1e9:.0f} GB/s: a [{c}, {c}] bf16 matrix in {floor_us:.2f} us\n')
  print('| rows | XLA options | XLA us / GEMM | kernel, PDL | kernel, no PDL | floor | rel. err XLA / kernel |')
  print('| ---: | --- | ---: | ---: | ---: | ---: | --- |')
  chains = {'xla': lambda h, ws: xla_chain(h, ws, args.length),
            'pdl': lambda h, ws: kernel_chain(h, ws, args.length, num_sms, True),
            'no_pdl': lambda h, ws: kernel_chain(h, ws, args.length, num_sms, False)}
  for r, options in itertools.product([int(v) for v in args.rows.split(',')], xla_variants(args.xla)):
    h = jax.random.normal(keys[0], (r, c))
    want = float32_chain(h, ws, args.length)
    us, errs = {}, {}
    for name, fn in chains.items():
      compiled = jax.jit(fn).lower(h, ws).compile(compiler_options=options or None)
      got = compiled(h, ws)
      errs[name] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
      us[name] = statistics.median(call_times(compiled, lambda i: (h, ws), args.warmup, args.iters)) * 1e6 / args.length
      if args.profile:
        print(f'  {name}, {r} rows, XLA options {options}:', flush=True)
        tag = '_'.join(f'{k}{v}' for k, v in options.items())
        print_top_device_ops(lambda: jax.block_until_ready(compiled(h, ws)), f'{args.profile}/{name}_{r}{tag}', top=8)
    times = ' | '.join(f'{us[name]:.2f}' for name in chains)
    print(f"| {r} | {options or 'defaults'} | {times} | {floor_us:.2f} | {errs['xla']:.1e} / {errs['pdl']:.1e} |",
          flush=True)

if __name__ == '__main__':
  main()
