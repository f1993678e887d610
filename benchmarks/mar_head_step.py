"""MAR's diffusion-head loop as the sampler runs it, under sets of XLA options: us per step, kernels
per step and the step's kernels, each option set's output against the first's.

  python3 benchmarks/mar_head_step.py --rows 8,16 --xla ';xla_gpu_experimental_gemm_fusion_v2=true'
  python3 benchmarks/mar_head_step.py --rows 8 --cache none,lazymar
  python benchmarks/mar_head_step.py --rows 4 --width 64 --depth 2 --z 32 --iters 2   # CPU check

`var_models.mar.diffloss.diffloss_sample` with guidance on `rows` rows (batch 1 at MAR-H: 2-14),
MAR-H's head by default (width 1536, 12 blocks, z 1280), bf16 Dense weights (cast once, as the
sampler does, `blocks.dense_params_in`), the adaLN outputs of every step computed before the loop
(`diffloss.adaln_ahead`), 100 steps; medians of --iters loops after --warmup, fresh keys per loop.
`--cache lazymar` runs the loop through LazyMAR's head cache (`accel.LazyMAR`'s official settings:
16 of the 100 steps on both halves and every block, the others on the conditional half with the
cached MLP outputs), as its sampler does at every iteration. On a GPU one more loop is traced and
its kernels counted and the GPU's idle time in it printed (`timing.device_gap_summary`).
"""
from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from sampling import compilation_cache
from timing import device_gap_summary, time_compiled, top_ops, trace_events, xla_variants
from accel.lazymar import LazyMAR
from configs import mar as mar_configs
from var_models.mar import from_config
from var_models.mar.diffloss import (DiffLossConfig, conditional_draws, diffloss_sample, diffloss_sample_cached,
                                     head_adaln, init_diffloss, merged_adaln)
from var_models.mar.gaussian_diffusion import create_diffusion
from var_models.mar.policy import IterPlan
from var_models.mar.schedule import MARSchedule, mask_schedule
from var_models.nn.blocks import dense_params_in
from var_models.nn.policy import Binding


def head(width: int, depth: int, z_channels: int, seed: int = 0):
  """(net, bf16 params with random biases and adaLN weights, merged adaLN) of a DiffLoss head: the
  official init zeroes the adaLN and output layers, which would make every step the same."""
  cfg = DiffLossConfig(target_channels=16, z_channels=z_channels, width=width, depth=depth, dtype=jnp.bfloat16)
  params = init_diffloss(cfg, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  params = jax.tree.unflatten(tree, [a + 0.02 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)])
  params = dense_params_in(params, jnp.bfloat16)
  return cfg.make_net(), params, merged_adaln(params)


def head_loop(cache_name: str, net, params, adaln, steps: int):
  """loop(params, adaln, z [R, Cz], key) -> tokens: the guided loop as the sampler runs it, plain
  ('none') or through LazyMAR's official head cache ('lazymar', bound to MAR-H's config)."""
  if cache_name == 'none':
    return jax.jit(lambda params, adaln, z, key: diffloss_sample(net, params, z, key, 1.0, 3.0, guided=True,
                                                                 adaln=adaln)), adaln
  if cache_name != 'lazymar':
    raise ValueError(f"--cache must be 'none' or 'lazymar', got {cache_name!r}")
  config = mar_configs.get_config('huge')
  config.attn_backend = 'xla'   # the config only binds the policy
  mar_cfg = from_config.mar_configs(config)[0]
  binding = Binding(mar_cfg, MARSchedule(mask_schedule(mar_cfg.seq_len, 64), steps), guided=True)
  cache = LazyMAR.preset('official').bind(binding).head_cache(IterPlan(tag='full'))
  diffusion = create_diffusion(str(steps))

  def loop(params, adaln, z, key):
    x_t, noise_fn = conditional_draws(key, z.shape[0] // 2, net.in_channels)
    return diffloss_sample_cached(net, params, z, x_t, noise_fn, 1.0, 3.0, cache, diffusion, adaln)
  return jax.jit(loop), head_adaln(net, params, cache, steps)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--rows', default='8,16', help='rows of the guided head (both CFG halves)')
  ap.add_argument('--width', type=int, default=1536)
  ap.add_argument('--depth', type=int, default=12)
  ap.add_argument('--z', type=int, default=1280, help='z channels (the decoder width)')
  ap.add_argument('--cache', default='none', help="'none' and/or 'lazymar' (LazyMAR's head cache), one run each")
  ap.add_argument('--xla', default='', help="';'-separated sets of XLA options ('a=1,b=true'; '' is XLA's defaults)")
  ap.add_argument('--warmup', type=int, default=2)
  ap.add_argument('--iters', type=int, default=8)
  args = compilation_cache.parse_args(ap)
  net, params, merged = head(args.width, args.depth, args.z)
  steps = 100
  for cache_name, rows in itertools.product(args.cache.split(','), (int(r) for r in args.rows.split(','))):
    loop, adaln = head_loop(cache_name, net, params, merged, steps)
    z = jax.random.normal(jax.random.key(2), (rows, args.z), jnp.float32)
    make_args = lambda i, z=z: (params, adaln, z, jax.random.key(i))
    lowered, first = loop.lower(*make_args(0)), None
    for k, options in enumerate(xla_variants(args.xla)):
      try:
        compiled, row = time_compiled(lowered, make_args, rows, args.warmup, args.iters, options)
      except Exception as e:   # an option this XLA does not have
        print(f'rows {rows} {options or "defaults"}: does not compile: {str(e).splitlines()[0][:160]}', flush=True)
        continue
      out = np.asarray(compiled(*make_args(0)))
      first = out if first is None else first
      print(f'cache {cache_name}, rows {rows} {options or "defaults"}: {row["median_ms"] * 1e3 / steps:.1f} us / step '
            f'(compile {row["compile_s"]:.1f} s); max |out - first set\'s| {np.abs(out - first).max():.2e}', flush=True)
      if jax.devices()[0].platform == 'gpu':
        events = trace_events(lambda: jax.block_until_ready(compiled(*make_args(0))),
                              f'/tmp/mar_head_{cache_name}_{rows}_{k}')
        ops, _ = top_ops(events['device'], 80)
        loop_ops = [(name, n, ms * 1e3 / n) for _, name, ms, n in ops if n >= steps // 10]
        print(f'  {sum(n for _, n, _ in loop_ops) / steps:.1f} kernels / step; per loop: ' +
              '; '.join(f'{name[:32]} x{n} {us:.2f} us' for name, n, us in loop_ops[:16]), flush=True)
        print(device_gap_summary(events), flush=True)


if __name__ == '__main__':
  main()
