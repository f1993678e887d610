"""fc1 + bias + tanh-GELU: the Mosaic GPU kernel against XLA's GEMM then GELU, on VAR-d30's
FFN shapes (K 1920, N 7680; M = 128 images x the tokens of the last scales).

  PYTHONPATH=. python3 benchmarks/dense_gelu.py

Prints per M the median ms, TFLOP/s and relative L2 error against a float32 reference
for XLA and for the kernel at a few ring depths, snake widths and release delays.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from sampling import compilation_cache
from pallas_kernels import dense_gelu_mgpu as dg
from pallas_kernels.dense_gelu import reference as xla
from timing import time_compiled


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--rows', default='32768,21632,12800,8192')
  ap.add_argument('--variants', default='4x8x0,4x8x1,3x8x0,4x16x0',
                  help='stages x grid_width x delay_release of the kernel')
  ap.add_argument('--iters', type=int, default=30)
  args = compilation_cache.parse_args(ap)
  k, n = 1920, 7680
  w = (jax.random.normal(jax.random.key(1), (k, n)) * 0.03).astype(jnp.bfloat16)
  b = (jax.random.normal(jax.random.key(2), (n,)) * 0.5).astype(jnp.bfloat16)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  for m in (int(r) for r in args.rows.split(',')):
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    ref = xla(x.astype(jnp.float32), w.astype(jnp.float32), b.astype(jnp.float32))
    runs = [('xla', xla)]
    for v in args.variants.split(','):
      stages, width, delay = (int(a) for a in v.split('x'))
      kernel = functools.partial(dg.dense_gelu, stages=stages, grid_width=width, delay_release=delay)
      runs.append((f'mosaic {stages} stages, width {width}, delay {delay}', kernel))
    for name, f in runs:
      compiled, row = time_compiled(jax.jit(f).lower(x, w, b), lambda i: (x, w, b), 1, 3, args.iters)
      err = jnp.linalg.norm(compiled(x, w, b).astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
      print(f"M {m:6d}  {name:36s} {row['median_ms']:7.3f} ms  "
            f"{2 * m * n * k / row['median_ms'] / 1e9:5.0f} TFLOP/s  rel err {float(err):.2e}", flush=True)


if __name__ == '__main__':
  main()
