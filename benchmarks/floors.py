"""The memory floor of a sampler: the weight bytes it must read from HBM, over the bandwidth a
device-to-device copy reaches in the same run.

  python3 benchmarks/floors.py --repeats 5 --pause 2   # the copy's spread, beside a read-only stream

At batch 1 a denoiser step's few rows make every GEMM a pass over its weights, so a sampler cannot
be faster than reading each network's weights (in the compute dtype) once per call of that network.
Activations (a handful of tokens per row) and KV caches are left out: at batch 1 they are under 1 %
of the weights of the workloads here, and at batch 16 the floor is the same weight traffic.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ecar.sampler import steps_per_stage
from timing import call_times


def _stream_rate(fn, x, nbytes: int, warmup: int, iters: int) -> float:
  """nbytes over the median seconds of `iters` calls fn(x) after `warmup` (compiled apart)."""
  compiled = jax.jit(fn).lower(x).compile()
  return nbytes / statistics.median(call_times(compiled, lambda i: (x,), warmup, iters))


def hbm_bandwidth(nbytes: int = 1 << 31, warmup: int = 3, iters: int = 20) -> float:
  """Bytes per second a device-to-device copy reaches: x + 1 over nbytes of uint32 reads and
  writes each byte once; median of `iters` calls after `warmup`."""
  return _stream_rate(lambda a: a + 1, jnp.zeros((nbytes // 4,), jnp.uint32), 2 * nbytes, warmup, iters)


def read_bandwidth(nbytes: int = 1 << 31, warmup: int = 3, iters: int = 20) -> float:
  """Bytes per second a read-only stream reaches: the sum of nbytes of uint32 (what a skinny GEMM
  does with its weights); median of `iters` calls after `warmup`."""
  return _stream_rate(lambda a: jnp.sum(a, dtype=jnp.uint32), jnp.ones((nbytes // 4,), jnp.uint32), nbytes,
                      warmup, iters)


def weight_bytes(tree, dtype) -> int:
  """Bytes of every array of `tree` stored in `dtype` (the compute dtype the GEMMs read)."""
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree)) * jnp.dtype(dtype).itemsize


def head_step_bytes(head, hooks, dtype) -> int:
  """Bytes of a DiffLoss head's weights (`head`, its params) that one step reads through a policy's
  `hooks` (a `HeadHooks`; None: every block): not the blocks in hooks.skipped, and where the step
  reuses every MLP output (hooks.needs_mlp False) only the adaLN gate columns of the blocks it runs."""
  blocks = [k for k in head if k.startswith('res_blocks_')]
  total = weight_bytes({k: v for k, v in head.items() if k not in blocks}, dtype)
  for name in blocks:
    if hooks is not None and int(name.rpartition('_')[2]) in hooks.skipped:
      continue
    if hooks is None or hooks.needs_mlp:
      total += weight_bytes(head[name], dtype)
    else:   # (shift, scale, gate): the gate's third of the adaLN Linear
      total += weight_bytes(head[name]['adaLN_modulation_1'], dtype) // 3
  return total


def sampler_reads(sample, params, dtype) -> dict:
  """{network: (bytes per call, calls)} of one call of `sample`, policy included: a MAR sampler
  (`make_mar_sampler`) on params {'mar', 'vae'} or an E-CAR sampler (`ecar.make_sampler`) on
  {'ecar', 'vae'} (vae None: no decoder). MAR: the encoder and decoder once an iteration (a
  policy's cached iterations still run every block), the diffusion head once a step as each
  iteration's head cache runs it (its mean bytes a step, `head_step_bytes`), the KL-16 decoder
  once. E-CAR: the AR once a stage, a stage's denoiser once an Euler step, the VAE decoder once."""
  vae, reads = params['vae'], {}
  if 'mar' in params:
    mar, steps = params['mar'], sample.diffusion.num_timesteps
    loop = lambda cache: [None] * steps if cache is None else [cache.hooks(k) for k in cache.kinds(steps)]
    head = sum(head_step_bytes(mar['diffloss'], hooks, dtype) for cache in sample.head_caches for hooks in loop(cache))
    calls = len(sample.head_caches) * steps
    reads['encoder + decoder'] = (weight_bytes({k: v for k, v in mar.items() if k != 'diffloss'}, dtype),
                                  len(sample.head_caches))
    reads['diffusion head'] = (head // calls, calls)
    name = 'KL-16 decoder'
  else:
    reads['AR'] = (weight_bytes(params['ecar']['ar'], dtype), sample.cfg.num_stages)
    for s, n in enumerate(steps_per_stage(sample.cfg, sample.steps)):
      reads[f'denoiser {s}'] = (weight_bytes(params['ecar'][f'denoiser_{s}'], dtype), n)
    name = 'VAE decoder'
  if vae is not None:
    reads[name] = (weight_bytes((vae['decoder'], vae['post_quant_conv']), dtype), 1)
  return reads


def floor(reads: Mapping[str, tuple[int, int]], bandwidth: float) -> dict:
  """reads {network: (bytes per call, calls)} -> {'seconds', 'bytes', 'reads'}: the time to read
  them all at `bandwidth` bytes/s."""
  total = sum(b * n for b, n in reads.values())
  return {'seconds': total / bandwidth, 'bytes': total, 'reads': dict(reads)}


def describe(f: dict, bandwidth: float) -> str:
  """One line: the floor, its bytes and bandwidth, and each network's share."""
  parts = ', '.join(f'{name} {b / 1e6:.0f} MB x {n}' for name, (b, n) in f['reads'].items())
  return (f"memory floor {f['seconds'] * 1e3:.2f} ms ({f['bytes'] / 1e9:.2f} GB at "
          f"{bandwidth / 1e9:.0f} GB/s: {parts})")


def main():
  ap = argparse.ArgumentParser(description="the copy's bandwidth measured again and again in one process, "
                               'beside a read-only stream')
  ap.add_argument('--copy_bytes', type=int, default=1 << 31)
  ap.add_argument('--repeats', type=int, default=5)
  ap.add_argument('--pause', type=float, default=2.0, help='seconds idle between repeats')
  args = ap.parse_args()
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  for i in range(args.repeats):
    copy, read = hbm_bandwidth(args.copy_bytes), read_bandwidth(args.copy_bytes)
    print(f'{i}: copy {copy / 1e9:.0f} GB/s, read-only {read / 1e9:.0f} GB/s', flush=True)
    time.sleep(args.pause)


if __name__ == '__main__':
  main()
