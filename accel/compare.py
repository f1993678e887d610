"""The fidelity runner: accelerated samplers against the baseline, on the same keys.

  python -m accel.compare --config configs/var.py:small256 --ckpt runs/small256 \
      --policy fastvar:var256 --seeds 0-63 [--lpips ckpt/lpips] [--out compare/small256]
  python -m accel.compare --config configs/mar.py:huge --ckpt ckpt/mar_h --policy lazymar:official
  python -m accel.compare --config configs/ecar.py:tiny --ckpt runs/demo --policy ecarcache:every_2

Any VAR, MAR or E-CAR checkpoint `python -m train.sample` loads (converted weights or a training
workdir); without --ckpt the weights are random, which shows speed only. The config, checkpoint,
batch and sampling flags (--top_k, --temperature, --num_steps, ...) are train.sample's
(`sampling.flags`); --batch_size defaults to 1, the papers' latency setting. Seed s samples with
key(s) (with --batch_size b > 1, each group of b seeds shares the key of its first) and label
--labels[i % n] (default: s mod num_classes). The baseline and every --policy (comma separated;
'a+b' composes VAR policies) run on the same keys and labels; per image, PSNR, SSIM and LPIPS
(with --lpips, a `python -m var_models.convert lpips` directory) of the accelerated image
against the baseline's; for VAR, per scale, the fraction of equal token ids; per sampler, the
median latency of a call (after a warm-up call, each sampler timed alone), compile time (the
programs compile --compile_workers at a time) and XLA's peak memory (weights + temporaries +
outputs of the compiled program). Writes, under --out, summary.md (one row per
policy, also printed), POLICY.json (every per-image figure) and POLICY.png (baseline |
accelerated pairs, the first --grid images). The comparison itself is `accel.fidelity` (importable
without this CLI's flags).
"""
from __future__ import annotations

import jax
import numpy as np
from absl import app, flags

from accel import metrics
from accel.fidelity import compare, parse_seeds
from accel.specs import policy_from_spec, split_specs
from sampling import compilation_cache, sampling_from_config
from sampling import flags as sf
from var_models.nn.checks import check_labels

_POLICY = flags.DEFINE_string('policy', None, "comma-separated policies, e.g. fastvar:infinity_2b ('a+b' composes), "
                              "lazymar:official, ecarcache:every_2, fastvar:infinity_2b[blocks=(3, 4)] (a setting)")
_SEEDS = flags.DEFINE_string('seeds', '0-15', "seeds, e.g. '0-63' or '0,5,9-12'")
_LABELS = flags.DEFINE_list('labels', None, 'class labels, cycled over the seeds (default: seed mod classes)')
_CFG = flags.DEFINE_float('cfg', None, "guidance scale (default: the config's sample.cfg)")
_LPIPS = flags.DEFINE_string('lpips', None, 'LPIPS params directory (python -m var_models.convert lpips)')
_OUT = flags.DEFINE_string('out', 'compare', 'output directory')
_GRID = flags.DEFINE_integer('grid', 16, 'image pairs in each PNG grid')
_WORKERS = flags.DEFINE_integer('compile_workers', 4, 'samplers compiled side by side (each compile is mostly '
                                'one thread; their compile times are then under that contention)', lower_bound=1)


def _labels(seeds: list[int], num_classes: int) -> np.ndarray:
  if _LABELS.value:
    pool = sf.integers(_LABELS)
    labels = np.array([pool[i % len(pool)] for i in range(len(seeds))], np.int32)
  else:
    labels = np.array(seeds, np.int32) % num_classes
  check_labels(labels, num_classes)
  return labels


def main(argv):
  del argv
  compilation_cache.enable(compilation_cache.COMPILATION_CACHE.value)
  config = sf.CONFIG.value
  sf.check_family(config)
  if sf.SEED.value is not None:
    raise ValueError("--seed: accel.compare samples each of --seeds (e.g. '0-63') with its own key")
  batch = sf.batch_size(1)   # the papers' latencies are of one image
  specs = split_specs(_POLICY.value or '')
  if not specs:
    raise ValueError('--policy: name at least one policy, e.g. fastvar:var256, lazymar:official, ecarcache:every_2')
  seeds = parse_seeds(_SEEDS.value)
  sampling = sampling_from_config(config, sf.overrides(config.family, _CFG.value))
  labels = _labels(seeds, sampling.num_classes)
  policies = {spec: policy_from_spec(spec, sampling.name) for spec in specs}
  for policy in policies.values():   # settings that do not fit the model fail here, before the parameters
    sampling.make(policy)
  family = sampling.with_params(sampling.load(sf.CKPT.value, jax.random.key(0)))
  lpips_params = metrics.load_lpips(_LPIPS.value) if _LPIPS.value else None
  print(f'device: {jax.devices()[0].device_kind}; {len(seeds)} images, batch {batch}, {family.options}', flush=True)
  if not sf.CKPT.value:
    print('random weights (no --ckpt): the times and memory hold, the fidelity columns do not (the official '
          "initialisations zero the output layers: MAR's diffusion head, say, then draws the same images under "
          'every policy)', flush=True)
  print(compare(family, policies, seeds, labels, batch, _OUT.value, lpips_params, _GRID.value, _WORKERS.value))


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
