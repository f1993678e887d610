"""One layer's cuDNN attention over KV caches stacked on a layer axis, three ways, each inside a loop
over the layers as a scanned sampler runs it:

  python3 benchmarks/paged_attention.py                       # Infinity-2B's heads, 32 layers
  python3 benchmarks/paged_attention.py --steps 21+36,6425+4096 --depth 40 --heads 28

  separate  a buffer per layer [B, capacity, H, D], read in place with its valid length (the
            unrolled sampler's caches);
  copied    layer i's valid keys copied out of the stack [depth, B, capacity, H, D] (the scanned
            sampler's caches: `LayerKVCaches.layer(i, length, rows)`);
  paged     cuDNN's paged attention over the whole stack, seen as pages of --page keys, with a
            page table that names layer i's pages: nothing copied.

--steps: `keys already cached + queries` of each step timed (Infinity's 1024 px schedule at scales
6, 8, 10 and 13 by default), 2 rows (a guided batch of 1), bf16. Medians of --iters calls after 2,
each call the sum of every layer's output (so nothing is left out); the paged and copied outputs
are compared with the separate ones.
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from timing import call_times


def median_ms(fn, args, iters: int) -> float:
  """Median ms of `iters` calls fn(*args) after 2 (`timing.call_times`)."""
  return statistics.median(call_times(fn, lambda i: args, 2, iters)) * 1e3


def programs(depth: int, batch: int, pages: int, page: int, queries: int, kv_len: int, scale: float):
  """{name: jitted fn} of the three ways (see the module docstring)."""
  lens = jnp.full((batch,), kv_len, jnp.int32)

  def dense(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=lens, implementation='cudnn')

  def separate(q, ks, vs):
    return sum(dense(q, k, v) for k, v in zip(ks, vs))

  def copied(q, k_all, v_all):
    def layer(i, out):
      k, v = (jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)[:, :kv_len] for a in (k_all, v_all))
      return out + dense(q, k, v)
    return jax.lax.fori_loop(0, depth, layer, jnp.zeros_like(q))

  def paged(q, k_all, v_all):
    k_pages, v_pages = (a.reshape(depth * batch * pages, page, *a.shape[3:]) for a in (k_all, v_all))
    q_lens = jnp.full((batch,), queries, jnp.int32)
    # cuDNN wants B x (pages per row) pages in all: each row lists depth * pages, layer i's first
    # and then its last again, which kv_len leaves unread.
    logical = jnp.minimum(jnp.arange(depth * pages), pages - 1)

    def layer(i, out):
      table = ((i * batch + jnp.arange(batch)[:, None]) * pages + logical[None]).astype(jnp.int32)[:, None, :, None]
      return out + cudnn_attention.paged_attention(q, k_pages, v_pages, q_lens, lens, table, table, scale=scale,
                                                   mask_type=cudnn_attention.MaskType.PADDING)
    return jax.lax.fori_loop(0, depth, layer, jnp.zeros_like(q))
  return {'separate': jax.jit(separate), 'copied': jax.jit(copied), 'paged': jax.jit(paged)}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--depth', type=int, default=32)
  ap.add_argument('--heads', type=int, default=16)
  ap.add_argument('--head_dim', type=int, default=128)
  ap.add_argument('--capacity', type=int, default=10560, help='keys per layer (a multiple of --page)')
  ap.add_argument('--page', type=int, default=64)
  ap.add_argument('--steps', default='21+36,265+256,1497+1024,6425+4096')
  ap.add_argument('--iters', type=int, default=30)
  args = ap.parse_args()
  if args.capacity % args.page:
    raise ValueError(f'--capacity {args.capacity} is not a multiple of --page {args.page}')
  batch, dtype, scale = 2, jnp.bfloat16, args.head_dim ** -0.5
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  shape = (args.depth, batch, args.capacity, args.heads, args.head_dim)
  k_all, v_all = (jax.random.normal(jax.random.key(i), shape, dtype) for i in (0, 1))
  ks, vs = list(k_all), list(v_all)
  for step in args.steps.split(','):
    cached, queries = (int(n) for n in step.split('+'))
    q = jax.random.normal(jax.random.key(2), (batch, queries, args.heads, args.head_dim), dtype)
    fns = programs(args.depth, batch, args.capacity // args.page, args.page, queries, cached + queries, scale)
    inputs = {'separate': (q, ks, vs), 'copied': (q, k_all, v_all), 'paged': (q, k_all, v_all)}
    ref = fns['separate'](*inputs['separate']).astype(jnp.float32)
    row = []
    for name, fn in fns.items():
      diff = float(jnp.max(jnp.abs(fn(*inputs[name]).astype(jnp.float32) - ref)))
      row.append(f'{name} {median_ms(fn, inputs[name], args.iters):8.3f} ms (max diff {diff:.3g})')
    print(f'{cached:6} cached + {queries:5} queries, {args.depth} layers: ' + '  '.join(row), flush=True)


if __name__ == '__main__':
  main()
