"""Would a LazyMAR-style token cache pay on E-CAR's last-stage denoiser? Both halves of the question.

  python benchmarks/ecar_token_cache.py --config configs/ecar.py:tiny --ckpt runs/demo --seeds 0-15
  python benchmarks/ecar_token_cache.py --cost L --batches 1,16            # GPU: what fewer tokens save

Change (a trained model): sampling with the baseline policy, at every Euler step of each stage, each
token's (patch_size-square patch of the velocity) relative change of the conditional velocity since
the previous step, ||v_c(i) - v_c(i-1)|| / ||v_c(i-1)||, and the same of the guidance residual
v_u - v_c (what `accel.ECARConditionCache` holds fixed between full steps). A token cache skips the
tokens whose output barely moves; it can only be as good as the share of such tokens.

Cost (random weights, bf16, cudnn attention, VAE decoder included): what a stage's Euler step costs
as its token count changes at fixed width, from whole-sampler timings with one stage cut to a
single step: per-step ms of stage s = (T(steps) - T(steps with stage s at 1)) / (steps[s] - 1). The
stages run 4 / 16 / 64 tokens (E-CAR-L, patch 4) through 5 / 6 / 8 blocks of the same width, so
ms per block-step against tokens bounds what skipping tokens in the last stage can save.
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from sampling import compilation_cache
import ecar
from accel.fidelity import parse_seeds
from sampling import family_from_config
from ecar.policy import FlowStep, StagePolicy
from ecar.sampler import steps_per_stage
from timing import call_times
from var_models.nn.policy import Halves


def _per_token(v: jax.Array, patch: int) -> jax.Array:
  """[B, g, g, D] -> [B, (g / p)^2, p * p * D]."""
  b, g, _, d = v.shape
  v = v.reshape(b, g // patch, patch, g // patch, patch, d).transpose(0, 1, 3, 2, 4, 5)
  return v.reshape(b, (g // patch) ** 2, patch * patch * d)


def _rel_change(now: jax.Array, prev: jax.Array, patch: int) -> jax.Array:
  """[B, T] relative change per token of [B, g, g, D] maps."""
  a, b = _per_token(now, patch), _per_token(prev, patch)
  return jnp.linalg.norm(a - b, axis=-1) / jnp.maximum(jnp.linalg.norm(b, axis=-1), 1e-12)


class ChangeRecorder(StagePolicy):
  """The baseline computation, reporting per Euler step (after a stage's first) each token's relative
  change of v_c and of v_u - v_c to the host (`jax.debug.callback`, keyed by stage and step). Its state
  holds per stage the previous step's [2, B, g, g, D] stack of v_c and v_u - v_c."""

  def __init__(self, cfg: ecar.ECARConfig):
    self.cfg, self.patch, self.records = cfg, cfg.patch_size, {}

  def init_state(self, batch: int):
    return tuple(jnp.zeros((2, batch, g, g, self.cfg.data_channels), jnp.float32) for g in self.cfg.stage_sizes)

  def _store(self, stage, step, change_c, change_r):
    self.records.setdefault((int(stage), int(step)), []).append((np.asarray(change_c), np.asarray(change_r)))

  def guide(self, site: FlowStep, halves: Halves, state):
    stage, step = site
    v_c, v_u = halves.both()
    prev_c, prev_r = state[stage]
    jax.lax.cond(step > 0, lambda: jax.debug.callback(
        self._store, stage, step, _rel_change(v_c, prev_c, self.patch), _rel_change(v_u - v_c, prev_r, self.patch)),
        lambda: None)
    state = state[:stage] + (jnp.stack([v_c, v_u - v_c]),) + state[stage + 1:]
    return (v_c, v_u), state


def change_report(args) -> None:
  from configs import ecar as ecar_configs   # pylint: disable=import-outside-toplevel
  path, _, variant = args.config.partition(':')
  if not path.endswith('ecar.py'):
    raise ValueError(f'--config must be configs/ecar.py:VARIANT, got {args.config!r}')
  config = ecar_configs.get_config(variant)
  family, cfg = family_from_config(config, args.ckpt, dict(num_steps=args.steps)), ecar.ecar_config(config)
  recorder = ChangeRecorder(cfg)
  sample = family.make(recorder)
  for seed in parse_seeds(args.seeds):
    labels = np.array([seed % family.num_classes], np.int32)
    jax.block_until_ready(sample(family.params, jax.random.key(seed), labels, **family.opts))
  steps = steps_per_stage(cfg, family.settings['num_steps'])
  print(f'{len(parse_seeds(args.seeds))} images, {steps} Euler steps, tokens per stage {cfg.stage_tokens}')
  print('| stage | tokens | quantity | median | p10 | p90 | tokens < 1 % | < 5 % | < 10 % |\n' + '| --- ' * 9 + '|')
  for s in range(cfg.num_stages):
    for q, name in ((0, 'v_c'), (1, 'v_u - v_c')):
      vals = np.concatenate([np.ravel(r[q]) for (st, _), rs in recorder.records.items() if st == s for r in rs])
      print(f'| {s} | {cfg.stage_tokens[s]} | {name} | {np.median(vals):.4f} | {np.percentile(vals, 10):.4f} | '
            f'{np.percentile(vals, 90):.4f} | {np.mean(vals < 0.01):.3f} | {np.mean(vals < 0.05):.3f} | '
            f'{np.mean(vals < 0.10):.3f} |')


def cost_report(args) -> None:
  from configs import ecar as ecar_configs   # pylint: disable=import-outside-toplevel
  config = ecar_configs.get_config(args.cost)
  config.dtype, config.attn_backend = 'bfloat16', args.attn
  cfg = ecar.ecar_config(config)
  full = steps_per_stage(cfg, 250)
  params = {'ecar': ecar.init_params(cfg, jax.random.key(0)), 'vae': ecar.init_vae_params(cfg, jax.random.key(1))}
  cuts = [full] + [full[:s] + (1,) + full[s + 1:] for s in range(cfg.num_stages)]
  print(f'E-CAR-{args.cost}: tokens per stage {cfg.stage_tokens}, blocks {cfg.den_depths}, steps {full}')
  print('| batch | stage | tokens | blocks | ms per Euler step | ms per block-step |\n' + '| --- ' * 6 + '|')
  for batch in (int(b) for b in args.batches.split(',')):
    labels = np.arange(batch, dtype=np.int32) % cfg.num_classes
    ms = []
    for steps in cuts:
      sample = ecar.make_sampler(cfg, num_steps=steps)
      compiled = sample.lower(params, jax.random.key(0), labels, cfg=1.5).compile()
      times = call_times(compiled, lambda i, sample=sample: sample.arguments(
          params, jax.random.key(i), labels, cfg=1.5), args.warmup, args.iters)
      ms.append(statistics.median(times) * 1e3)
    for s in range(cfg.num_stages):
      step = (ms[0] - ms[s + 1]) / (full[s] - 1)
      print(f'| {batch} | {s} | {cfg.stage_tokens[s]} | {cfg.den_depths[s]} | {step:.4f} | '
            f'{step / cfg.den_depths[s]:.4f} |', flush=True)
    print(f'| {batch} | all | | | sampler {ms[0]:.2f} ms | |', flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--config', default='configs/ecar.py:tiny')
  ap.add_argument('--ckpt', default=None, help='a training workdir (random weights without)')
  ap.add_argument('--seeds', default='0-15')
  ap.add_argument('--steps', type=int, default=None, help='Euler steps in all (default: the config\'s)')
  ap.add_argument('--cost', default='', help='an E-CAR size (S, B, L): time the stages instead')
  ap.add_argument('--batches', default='1,16')
  ap.add_argument('--attn', default='cudnn')
  ap.add_argument('--warmup', type=int, default=2)
  ap.add_argument('--iters', type=int, default=10)
  args = compilation_cache.parse_args(ap)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  (cost_report if args.cost else change_report)(args)


if __name__ == '__main__':
  main()
