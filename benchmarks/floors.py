"""The memory floor of a sampler: the weight bytes it must read from HBM, over the bandwidth a
device-to-device copy reaches in the same run (the fastest of five measurements).

  python3 benchmarks/floors.py --repeats 5 --pause 2   # the copy's spread, beside a read-only stream

At batch 1 a denoiser step's few rows make every GEMM a pass over its weights, so a sampler cannot
be faster than reading each network's weights (in the compute dtype) once per call of that network:
issue 40's floor. The traffic floor counts what the program at a batch reads: where a loop's steps
take their adaLN outputs from one GEMM before the loop, those Linears (a third of an E-CAR
denoiser's weights, 60 % of MAR's head's) are read once a loop, not once a step.
Activations (a handful of tokens per row) and KV caches are left out: at batch 1 they are under 1 %
of the weights of the workloads here, and at batch 16 the floor is the same weight traffic.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ecar.sampler import steps_per_stage
from var_models.nn.blocks import adaln_ahead_pays
from timing import call_times


def _stream_rate(fn, x, nbytes: int, warmup: int, iters: int, repeats: int) -> float:
  """nbytes over the median seconds of `iters` calls fn(x) after `warmup` (compiled apart); the
  highest of `repeats` such medians."""
  compiled = jax.jit(fn).lower(x).compile()
  return max(nbytes / statistics.median(call_times(compiled, lambda i: (x,), warmup, iters)) for _ in range(repeats))


def hbm_bandwidth(nbytes: int = 1 << 31, warmup: int = 3, iters: int = 20, repeats: int = 5) -> float:
  """Bytes per second a device-to-device copy reaches: x + 1 over nbytes of uint32 reads and
  writes each byte once; the highest of `repeats` medians of `iters` calls after `warmup` (one
  median varies by +-9 % on an H200 from one measurement to the next, and a floor at a rate the
  hardware beat would flatter the times beside it)."""
  return _stream_rate(lambda a: a + 1, jnp.zeros((nbytes // 4,), jnp.uint32), 2 * nbytes, warmup, iters, repeats)


def read_bandwidth(nbytes: int = 1 << 31, warmup: int = 3, iters: int = 20, repeats: int = 5) -> float:
  """Bytes per second a read-only stream reaches: the sum of nbytes of uint32 (what a skinny GEMM
  does with its weights); the highest of `repeats` medians of `iters` calls after `warmup`."""
  return _stream_rate(lambda a: jnp.sum(a, dtype=jnp.uint32), jnp.ones((nbytes // 4,), jnp.uint32), nbytes,
                      warmup, iters, repeats)


def weight_bytes(tree, dtype) -> int:
  """Bytes of every array of `tree` stored in `dtype` (the compute dtype the GEMMs read)."""
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree)) * jnp.dtype(dtype).itemsize


def head_reads(head, hooks, dtype) -> tuple[int, int]:
  """(rest, adaLN) bytes of a DiffLoss head's weights (`head`, its params) that one step reads through
  a policy's `hooks` (a `HeadHooks`; None: every block), apart: `adaLN` the adaLN Linears of the final
  layer and of the blocks it runs, and the time and condition embeddings (what `diffloss.adaln_ahead`
  reads once a loop where it computes the steps' adaLN outputs ahead), `rest` the others. No weights
  of the blocks in hooks.skipped; where the step reuses every MLP output (hooks.needs_mlp False),
  only the gate columns of its blocks' adaLN Linears and nothing else of them."""
  blocks = [k for k in head if k.startswith('res_blocks_')]
  ahead = ('time_embed', 'cond_embed')
  adaln = weight_bytes([head[k] for k in ahead] + [head['final_layer']['adaLN_modulation_1']], dtype)
  rest = weight_bytes({k: v for k, v in head.items() if k not in blocks + ['final_layer', *ahead]}, dtype)
  rest += weight_bytes({k: v for k, v in head['final_layer'].items() if k != 'adaLN_modulation_1'}, dtype)
  for name in blocks:
    if hooks is not None and int(name.rpartition('_')[2]) in hooks.skipped:
      continue
    block_adaln = weight_bytes(head[name]['adaLN_modulation_1'], dtype)
    if hooks is None or hooks.needs_mlp:
      adaln += block_adaln
      rest += weight_bytes({k: v for k, v in head[name].items() if k != 'adaLN_modulation_1'}, dtype)
    else:   # (shift, scale, gate): the gate's third of the adaLN Linear
      adaln += block_adaln // 3
  return rest, adaln


def denoiser_reads(den, dtype) -> tuple[int, int, int]:
  """(rest, adaLN, condition) bytes of an E-CAR denoiser's weights (`den`, its params) a flow step reads:
  `adaLN` every adaLN Linear and the time embedding (what the sampler reads once a stage where it
  computes the steps' adaLN outputs ahead), `condition` the projection of the AR's tokens (computed
  once a stage), `rest` the others."""
  blocks = [k for k in den if k.startswith('blocks_')]
  adaln = weight_bytes([den[k]['adaLN_modulation'] for k in blocks + ['final']] + [den['t_embed']], dtype)
  condition = weight_bytes(den['cond_proj'], dtype)
  return weight_bytes(den, dtype) - adaln - condition, adaln, condition


def _mar_reads(sample, mar, dtype, batch) -> dict:
  """`sampler_reads` of a MAR sampler: the head's loops step by step, each step kind's rows (B x the
  most tokens an iteration predicts, to which every iteration pads, x 2 where the step runs both CFG
  halves) deciding whether its adaLN outputs come ahead (`blocks.adaln_ahead_pays`)."""
  steps, rows = sample.diffusion.num_timesteps, None if batch is None else batch * sample.schedule.mask.max_pred
  step_bytes = ahead_bytes = 0
  for cache in sample.head_caches:
    kinds = [None] * steps if cache is None else list(cache.kinds(steps))
    for kind in dict.fromkeys(kinds):
      hooks = None if cache is None else cache.hooks(kind)
      rest, adaln = head_reads(mar['diffloss'], hooks, dtype)
      both = sample.guided and (cache is None or cache.uncond(kind))
      ahead = batch is not None and adaln_ahead_pays(rows * (2 if both else 1))
      step_bytes += kinds.count(kind) * (rest if ahead else rest + adaln)
      ahead_bytes += adaln if ahead else 0
  iterations, calls = len(sample.head_caches), len(sample.head_caches) * steps
  reads = {'encoder + decoder': (weight_bytes({k: v for k, v in mar.items() if k != 'diffloss'}, dtype), iterations),
           'diffusion head': (step_bytes // calls, calls)}
  if ahead_bytes:
    reads['diffusion head adaLN, ahead'] = (ahead_bytes // iterations, iterations)
  return reads


def _ecar_reads(sample, ecar_params, dtype, batch) -> dict:
  """`sampler_reads` of an E-CAR sampler: stage s's rows (2B x its tokens) deciding whether its
  adaLN outputs come ahead."""
  reads = {'AR': (weight_bytes(ecar_params['ar'], dtype), sample.cfg.num_stages)}
  for s, n in enumerate(steps_per_stage(sample.cfg, sample.steps)):
    rest, adaln, condition = denoiser_reads(ecar_params[f'denoiser_{s}'], dtype)
    if batch is None:
      reads[f'denoiser {s}'] = (rest + adaln + condition, n)
      continue
    ahead = adaln_ahead_pays(2 * batch * sample.cfg.stage_tokens[s])
    reads[f'denoiser {s}'] = (rest if ahead else rest + adaln, n)
    reads[f'denoiser {s} once a stage'] = (condition + (adaln if ahead else 0), 1)
  return reads


def sampler_reads(sample, params, dtype, batch: Optional[int] = None) -> dict:
  """{network: (bytes per call, calls)} of one call of `sample`, policy included: a MAR sampler
  (`make_mar_sampler`) on params {'mar', 'vae'} or an E-CAR sampler (`ecar.make_sampler`) on
  {'ecar', 'vae'} (vae None: no decoder).
  batch None: issue 40's count, every weight of a network each time it runs: MAR's encoder and
  decoder once an iteration (a policy's cached iterations still run every block), the diffusion
  head once a step as each iteration's head cache runs it (its mean bytes a step, `head_reads`),
  E-CAR's AR once a stage and a stage's denoiser once an Euler step, the decoder once.
  batch B: what the program at that batch reads: the same, but weights its loops use the same way
  at every step read once a loop (the adaLN Linears where the steps' adaLN outputs come ahead,
  E-CAR's condition projection), rows permitting."""
  if 'mar' in params:
    reads, name = _mar_reads(sample, params['mar'], dtype, batch), 'KL-16 decoder'
  else:
    reads, name = _ecar_reads(sample, params['ecar'], dtype, batch), 'VAE decoder'
  if params['vae'] is not None:
    reads[name] = (weight_bytes((params['vae']['decoder'], params['vae']['post_quant_conv']), dtype), 1)
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
  ap = argparse.ArgumentParser(description="the copy's bandwidth measured again and again in one process (each "
                               'a median of 20 calls), beside a read-only stream')
  ap.add_argument('--copy_bytes', type=int, default=1 << 31)
  ap.add_argument('--repeats', type=int, default=5)
  ap.add_argument('--pause', type=float, default=2.0, help='seconds idle between repeats')
  args = ap.parse_args()
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  for i in range(args.repeats):
    copy, read = hbm_bandwidth(args.copy_bytes, repeats=1), read_bandwidth(args.copy_bytes, repeats=1)
    print(f'{i}: copy {copy / 1e9:.0f} GB/s, read-only {read / 1e9:.0f} GB/s', flush=True)
    time.sleep(args.pause)


if __name__ == '__main__':
  main()
