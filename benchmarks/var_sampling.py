"""VAR sampling speed: d16 / d30 at 256 px, bf16 compute, attention backends side by side.

  python benchmarks/var_sampling.py --depths 16,30 --batches 1,16,64 --backends cudnn,xla

Random weights (official init), the paper's FID sampling settings (cfg 1.5,
top-k 900, top-p 0.96). Compile time is measured apart (lower + compile); run
times are medians over --iters calls after --warmup calls, each call with a
fresh key, timed on the host after block_until_ready.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from sampling import compilation_cache
import pallas_kernels as pk
from var_models.tokenizers.vqvae import VQVAE, VQVAEConfig
from var_models.var.model import VARConfig
from var_models.var.sampler import make_sampler
from timing import entry_op_counts, print_top_device_ops, time_compiled, xla_variants
from var_models.var.from_config import init_var_params


def cast_var_params(params, dtype):
  """VAR weights stored in the compute dtype (what fp16 autocast reads); the VQVAE stays float32."""
  return {'var': jax.tree_util.tree_map(lambda p: p.astype(dtype), params['var']), 'vqvae': params['vqvae']}


def time_sampler(sample, params, batch: int, warmup: int, iters: int, hlo_stats: bool = False,
                 profile: str = '', xla: dict | None = None) -> dict:
  labels = np.arange(batch, dtype=np.int32) % 1000
  opts = dict(cfg=1.5, top_k=900, top_p=0.96)
  lab, cfg = jnp.asarray(labels), jnp.float32(opts['cfg'])
  compiled, row = time_compiled(sample.lower(params, jax.random.key(0), labels, **opts),
                                lambda i: (params, jax.random.key(i), lab, cfg), batch, warmup, iters, xla)
  if hlo_stats:
    print('  entry ops:', entry_op_counts(compiled), flush=True)
  if profile:
    print_top_device_ops(lambda: jax.block_until_ready(compiled(params, jax.random.key(7), lab, cfg)), profile,
                         top=40)
  return row


def time_decode(params, batch: int, warmup: int, iters: int) -> dict:
  """The VQVAE decoder alone (f_hat -> image, bf16 compute), the sampler's last stage."""
  vq_cfg = VQVAEConfig(dtype=jnp.bfloat16)
  hw = vq_cfg.patch_nums[-1]
  f_hat = jax.random.normal(jax.random.key(1), (batch, hw, hw, vq_cfg.z_channels))
  decode = jax.jit(lambda p, f: VQVAE(vq_cfg).apply({'params': p}, f, method=VQVAE.fhat_to_img))
  _, row = time_compiled(decode.lower(params['vqvae'], f_hat), lambda i: (params['vqvae'], f_hat + i),
                         batch, warmup, iters)
  return row


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
  ap.add_argument('--profile', default='', help='trace one call into this folder; print the top kernels')
  ap.add_argument('--decode', action='store_true', help='also time the VQVAE decoder alone per batch')
  ap.add_argument('--kernels', default='auto', help="pallas_kernels' 'auto' and/or 'reference' "
                  "(the Hopper dense-GELU kernel in the FFNs, or XLA's GEMM + GELU), side by side")
  ap.add_argument('--xla', default='', help="XLA compiler-option variants side by side, e.g. "
                  "';xla_gpu_enable_cublaslt=true' (XLA's defaults, then cuBLASLt)")
  args = compilation_cache.parse_args(ap)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  rows = []
  for depth in [int(d) for d in args.depths.split(',')]:
    base = init_var_params(VARConfig(depth=depth), VQVAEConfig(), jax.random.key(depth))
    if args.decode and depth == int(args.depths.split(',')[0]):
      for batch in [int(b) for b in args.batches.split(',')]:
        r = time_decode(base, batch, args.warmup, args.iters)
        print(f"VQVAE decode B={batch:<3} median {r['median_ms']:8.2f} ms  per image {r['per_image_ms']:7.3f} ms",
              flush=True)
    for pdt in args.param_dtypes.split(','):
      params = cast_var_params(base, jnp.dtype(pdt))
      for backend, kernels in itertools.product(args.backends.split(','), args.kernels.split(',')):
        var_cfg = VARConfig(depth=depth, dtype=jnp.bfloat16, attn_backend=backend)
        # A fresh sampler per setting: the override acts at trace time, and a jit cache ignores it.
        sample = make_sampler(var_cfg, VQVAEConfig(dtype=jnp.bfloat16))
        for batch, xla in itertools.product([int(b) for b in args.batches.split(',')], xla_variants(args.xla)):
          with contextlib.nullcontext() if kernels == 'auto' else pk.override(kernels):
            timed = time_sampler(sample, params, batch, args.warmup, args.iters, args.hlo_stats,
                                 args.profile, xla)
          r = dict(depth=depth, backend=backend, kernels=kernels, param_dtype=pdt, batch=batch, xla=xla,
                   **timed)
          rows.append(r)
          print(f"d{depth:<3} {backend:6} {pdt:9} kernels {kernels:9} B={batch:<3} xla {xla or 'defaults'}  "
                f"compile {r['compile_s']:6.1f} s  median {r['median_ms']:8.2f} ms  per image {r['per_image_ms']:7.3f} ms  "
                f"[{r['min_ms']:.2f}, {r['max_ms']:.2f}]", flush=True)
    del base
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=1)


if __name__ == '__main__':
  main()
