"""Unrolled against scanned transformer blocks: compile time and run time of one VAR scale step,
and of a training step through E-CAR's AR blocks (--train).

  python3 benchmarks/scan_layers.py --depth 32 --width 2048 --heads 16 --tokens 1,256,4096 --cache 6000
  python benchmarks/scan_layers.py --depth 4 --width 64 --heads 2 --tokens 4 --cache 16 --dtype float32 --xla ''
  python3 benchmarks/scan_layers.py --train --depth 20 --width 1024 --heads 16 --tokens 4,16,64 --rows 64

One scale step of a VAR sampler: `tokens` queries per row over a KV cache that already holds
`cache` keys, 2 rows (a guided batch of 1), through `depth` of VAR's AdaLN blocks (random
weights, unmasked attention as at a one-scale step):
  unrolled  a Python loop over each block's own parameters and KV cache (today's samplers);
  scan      `lax.scan` over the parameters stacked on a leading layer axis, the KV caches stacked
            too: each layer's valid keys sliced out, its new keys written back in place.
Each program is compiled apart under each set of XLA options of --xla (';'-separated, '' for the
defaults), then timed (median of --iters calls after --warmup), beside the floor of reading every
block's weights once (`floors.py`) at the bandwidth a copy reaches in the same run.
`xla_gpu_enable_dynamic_slice_fusion` lets a library GEMM (cuBLAS) read a layer's slice of the
stacked weights in place; the Triton GEMM fusions XLA picks for few rows copy the slice first,
hence the variant with `xla_gpu_enable_triton_gemm=false` too.
The scanned program's outputs are checked against the unrolled one's.

--train: the loss and gradients of `depth` of E-CAR's AR blocks (timm's ViT block, float32
parameters, --dtype compute, block-causal attention over stages of --tokens tokens each, --rows
rows), unrolled against a `lax.scan` over the stacked parameters. Each is timed three ways
(`timing.step_times`): synced, the host's dispatch, and back to back as the trainer runs steps;
the gradients of the two are compared.
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

import floors
from accel.timing import compiled_in
from sampling import compilation_cache
from timing import step_times, time_compiled, xla_variants
from var_models.nn import attention as attn_lib
from var_models.nn.attention import KVCache
from var_models.nn.blocks import AdaLNSelfAttn, trunc_normal
from var_models.nn.scan import stack_layers
from var_models.nn.vit import Block


def block(width: int, heads: int, dtype) -> AdaLNSelfAttn:
  init = trunc_normal(math.sqrt(1 / (3 * width)))
  return AdaLNSelfAttn(width, heads, 4.0, 1e-6, True, False, 0.0, init, init, init, 0.0, 'xla', dtype)


def unrolled(blk, params, x, mods, ks, vs, cache: int):
  """params, ks, vs: per-layer lists -> (x, new keys [depth, B, l, H, D])."""
  new = []
  for p, mod, k, v in zip(params, mods, ks, vs):
    x, kv, _ = blk.apply({'params': p}, x, mod, kv=KVCache(k, v, cache))
    new.append(kv.k[:, cache:kv.length])
  return x, jnp.stack(new)


def scanned(blk, params, x, mods, ks, vs, cache: int):
  """params, ks, vs stacked on a leading layer axis -> (x, new keys [depth, B, l, H, D])."""
  l = x.shape[1]

  def body(carry, layer):
    x, ks, vs = carry
    p, mod, i = layer
    index = (i, 0, 0, 0, 0)
    k = jax.lax.dynamic_slice(ks, index, (1,) + ks.shape[1:2] + (cache + l,) + ks.shape[3:])[0]
    v = jax.lax.dynamic_slice(vs, index, (1,) + vs.shape[1:2] + (cache + l,) + vs.shape[3:])[0]
    x, kv, _ = blk.apply({'params': p}, x, mod, kv=KVCache(k, v, cache))
    at = (i, 0, cache, 0, 0)
    ks = jax.lax.dynamic_update_slice(ks, kv.k[None, :, cache:], at)
    vs = jax.lax.dynamic_update_slice(vs, kv.v[None, :, cache:], at)
    return (x, ks, vs), kv.k[:, cache:]

  (x, _, _), new = jax.lax.scan(body, (x, ks, vs), (params, mods, jnp.arange(len(mods))))
  return x, new


def train_unrolled(blk, params, x, mask):
  """params: per-layer list -> (loss, grads) of the mean square of the blocks' output."""
  def loss(params):
    h = x
    for p in params:
      h, _, _ = blk.apply({'params': p}, h, mask=mask)
    return jnp.mean(jnp.square(h.astype(jnp.float32)))
  return jax.value_and_grad(loss)(params)


def train_scanned(blk, params, x, mask):
  """params stacked on a leading layer axis -> (loss, grads stacked)."""
  def loss(params):
    h, _ = jax.lax.scan(lambda h, p: (blk.apply({'params': p}, h, mask=mask)[0], None), x, params)
    return jnp.mean(jnp.square(h.astype(jnp.float32)))
  return jax.value_and_grad(loss)(params)


def train_main(args):
  """--train: unrolled against scanned loss and gradients through E-CAR's AR blocks."""
  dtype = jnp.dtype(args.dtype)
  stage_tokens = [int(t) for t in args.tokens.split(',')]
  levels = np.repeat(np.arange(len(stage_tokens), dtype=np.int32), stage_tokens)
  mask = attn_lib.ScaleCausal(levels, levels)
  blk = Block(args.width, args.heads, 4.0, backend=args.attn_backend, dtype=dtype)
  x = jax.random.normal(jax.random.key(3), (args.rows, len(levels), args.width), dtype)
  keys = jax.random.split(jax.random.key(0), args.depth)
  per_layer = [jax.jit(blk.init)(k, x[:1])['params'] for k in keys]
  programs = {'unrolled': (train_unrolled, per_layer),
              'scan': (train_scanned, stack_layers(per_layer))}
  grads = {}
  for options in xla_variants(args.xla):
    for name, (fn, params) in programs.items():
      compiled, compile_s = compiled_in(jax.jit(lambda p, x: fn(blk, p, x, mask)).lower(params, x), options)
      ms, (loss, grads[name]) = step_times(lambda: compiled(params, x), args.warmup, args.iters)
      print(f"{name:8} {str(options or 'XLA defaults'):45} compile {compile_s:6.1f} s  synced {ms['synced']:8.3f} ms  "
            f"dispatch {ms['dispatch']:8.3f} ms  back to back {ms['back_to_back']:8.3f} ms  loss {float(loss):.6f}",
            flush=True)
    stacked = stack_layers(grads['unrolled'])
    diff = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30))
               for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(grads['scan'])))
    print(f'scan against unrolled: gradients within {diff:.3g} of their largest entry', flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--depth', type=int, default=32)
  ap.add_argument('--width', type=int, default=2048)
  ap.add_argument('--heads', type=int, default=16)
  ap.add_argument('--tokens', default='1,256,4096', help='queries per row at the step')
  ap.add_argument('--cache', type=int, default=6000, help='keys already in the cache')
  ap.add_argument('--dtype', default='bfloat16')
  ap.add_argument('--xla', default=';xla_gpu_enable_dynamic_slice_fusion=true;'
                  'xla_gpu_enable_dynamic_slice_fusion=true,xla_gpu_enable_triton_gemm=false')
  ap.add_argument('--warmup', type=int, default=3)
  ap.add_argument('--iters', type=int, default=20)
  ap.add_argument('--copy_bytes', type=int, default=1 << 31)
  ap.add_argument('--train', action='store_true', help="E-CAR's AR blocks' loss and gradients (--tokens: per stage)")
  ap.add_argument('--rows', type=int, default=64, help='--train: rows of the batch')
  ap.add_argument('--attn_backend', default='xla', help="--train: the blocks' attention backend (cudnn on GPUs)")
  args = compilation_cache.parse_args(ap)
  if args.train:
    return train_main(args)
  dtype = jnp.dtype(args.dtype)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  bandwidth = floors.hbm_bandwidth(args.copy_bytes)
  blk = block(args.width, args.heads, dtype)
  c, h, rows = args.width, args.heads, 2
  keys = jax.random.split(jax.random.key(0), args.depth)
  x0 = jnp.zeros((rows, 1, c), dtype)
  per_layer = [jax.jit(blk.init)(k, x0, jnp.zeros((rows, 6, c), dtype))['params'] for k in keys]
  per_layer = [jax.tree.map(lambda a: a.astype(dtype), p) for p in per_layer]
  stacked = stack_layers(per_layer)
  weights = floors.weight_bytes(per_layer, dtype)
  mods = jax.random.normal(jax.random.key(1), (args.depth, rows, 6, c), dtype) * 0.1
  print(f'{args.depth} blocks of width {c}: {weights / 1e9:.2f} GB of weights; floor at '
        f'{bandwidth / 1e9:.0f} GB/s: {weights / bandwidth * 1e3:.3f} ms', flush=True)
  for l in [int(t) for t in args.tokens.split(',')]:
    shape = (args.depth, rows, args.cache + l, h, c // h)
    kv_all = jax.random.normal(jax.random.key(2), (2,) + shape, dtype)
    x = jax.random.normal(jax.random.key(3), (rows, l, c), dtype)
    programs = {
        'unrolled': (jax.jit(lambda p, x, m, k, v: unrolled(blk, p, x, m, k, v, args.cache)),
                     (per_layer, x, list(mods), list(kv_all[0]), list(kv_all[1]))),
        'scan': (jax.jit(lambda p, x, m, k, v: scanned(blk, p, x, m, k, v, args.cache)),
                 (stacked, x, mods, kv_all[0], kv_all[1])),
    }
    outputs = {}
    for options in xla_variants(args.xla):
      for name, (fn, inputs) in programs.items():
        compiled, row = time_compiled(fn.lower(*inputs), lambda i: inputs, 1, args.warmup, args.iters, options)
        outputs[name] = compiled(*inputs)
        print(f"l={l:<5} {name:8} {str(options or 'XLA defaults'):45} compile {row['compile_s']:6.1f} s  "
              f"median {row['median_ms']:8.3f} ms  {row['median_ms'] / (weights / bandwidth * 1e3):5.2f}x the "
              f'weight floor', flush=True)
      diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                 for a, b in zip(jax.tree.leaves(outputs['unrolled']), jax.tree.leaves(outputs['scan'])))
      print(f'l={l:<5} scan against unrolled: max abs difference {diff:.3g}', flush=True)


if __name__ == '__main__':
  main()
