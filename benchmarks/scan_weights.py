"""Where a loop over stacked weights reads a layer's weights from: in place, or a copy per layer.

  python3 benchmarks/scan_weights.py                  # 16 layers of [2048, 8192] bf16, 16 rows
  python benchmarks/scan_weights.py --layers 2 --k 64 --n 128 --rows 4 --xla ''    # on a CPU

The sum over layers of x [rows, K] @ w[i] [K, N] (+ b[i] [N] with --bias: 'fused' where XLA may
fold the add into the GEMM, 'apart' after an optimization barrier, so that the GEMM stays a plain
one), compiled under each set of XLA options of --xla (';'-separated, '' for the defaults), the
layer's weights taken five ways:
  xs index        `lax.scan` over the layer indices, w[i] a dynamic slice (the index a scanned input);
  counter         `lax.fori_loop`, w[i] indexed by the loop's counter;
  xs weights      `lax.scan` over w itself (XLA slices its input per iteration);
  stack in jit    the layers' separate weights stacked inside the program, then as 'xs index'
                  (what a scan over flax's per-block parameters does on every call);
  separate        a Python loop over the separate weights (the unrolled program).
Per variant: the median of --iters calls after one, and how the optimised program names its
pieces (dynamic slices, dynamic-slice fusions, cuBLAS and Triton GEMMs, copies), counted in its
text: a dynamic-slice fusion around a cuBLAS call reads the slice in place.
"""
from __future__ import annotations

import argparse
import re
import statistics

import jax
import jax.numpy as jnp

from sampling import compilation_cache
from timing import call_times, xla_variants

PIECES = {'dynamic-slice': 'dynamic-slice', 'dynamic-slice fusion': 'dynamic_slice_fusion|dynamic-slice-fusion|address_computation',
          'cuBLAS': 'cublas', 'Triton GEMM': 'triton_gemm|__triton', 'copy': 'copy'}


def variants(layers: int, rows: int, n: int, bias: str):
  """{name: (fn(x, (w, b), idx), takes the separate weights)}."""
  zeros = lambda: jnp.zeros((rows, n), jnp.bfloat16)
  at = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)
  dense = {'none': lambda x, w, b: x @ w, 'fused': lambda x, w, b: x @ w + b,
           'apart': lambda x, w, b: jax.lax.optimization_barrier(x @ w) + b}[bias]
  layer = lambda x, wb, i: dense(x, at(wb[0], i), at(wb[1], i))

  def xs_index(x, wb, idx):
    return jax.lax.scan(lambda c, i: (c + layer(x, wb, i), None), zeros(), idx)[0]
  return {
      'xs index': (xs_index, False),
      'counter': (lambda x, wb, idx: jax.lax.fori_loop(0, layers, lambda i, c: c + layer(x, wb, i), zeros()), False),
      'xs weights': (lambda x, wb, idx: jax.lax.scan(lambda c, l: (c + dense(x, *l), None), zeros(), wb)[0], False),
      'stack in jit': (lambda x, wb, idx: xs_index(x, (jnp.stack(wb[0]), jnp.stack(wb[1])), idx), True),
      'separate': (lambda x, wb, idx: sum(dense(x, w, b) for w, b in zip(*wb)), True),
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--layers', type=int, default=16)
  p.add_argument('--k', type=int, default=2048)
  p.add_argument('--n', type=int, default=8192)
  p.add_argument('--rows', type=int, default=16)
  p.add_argument('--iters', type=int, default=20)
  p.add_argument('--bias', choices=('none', 'fused', 'apart'), default='none',
                 help="each layer's bias: none, added where XLA may fuse it, or after a barrier")
  p.add_argument('--xla', default=';xla_gpu_enable_dynamic_slice_fusion=true;'
                                  'xla_gpu_enable_dynamic_slice_fusion=true,xla_gpu_enable_triton_gemm=false')
  args = compilation_cache.parse_args(p)
  w = jax.random.normal(jax.random.key(0), (args.layers, args.k, args.n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (args.layers, args.n), jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (args.rows, args.k), jnp.bfloat16)
  idx, wbs = jnp.arange(args.layers, dtype=jnp.int32), (list(w), list(b))
  print(f'{jax.devices()[0].device_kind}: {args.layers} layers of [{args.k}, {args.n}] bf16 '
        f'({w.nbytes / 1e6:.0f} MB), {args.rows} rows, bias {args.bias}\n')
  print('| XLA options | weights | ms | ' + ' | '.join(PIECES) + ' |\n' + '| --- ' * (3 + len(PIECES)) + '|')
  for options in xla_variants(args.xla):
    for name, (fn, separate) in variants(args.layers, args.rows, args.n, args.bias).items():
      inputs = (x, wbs if separate else (w, b), idx)
      compiled = jax.jit(fn).lower(*inputs).compile(options or None)
      text = compiled.as_text()
      ms = statistics.median(call_times(compiled, lambda i: inputs, 1, args.iters)) * 1e3
      counts = ' | '.join(str(len(re.findall(pattern, text))) for pattern in PIECES.values())
      label = ', '.join(f'{k}={v}' for k, v in options.items()) or 'defaults'
      print(f'| {label} | {name} | {ms:.3f} | {counts} |', flush=True)


if __name__ == '__main__':
  main()
