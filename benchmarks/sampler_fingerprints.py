"""SHA-256 of every sampler's output for fixed keys: the tiny VAR, MAR and E-CAR (random weights, CPU)
under the baseline and each accelerator, for checking that a refactor leaves every image bit-identical.

  JAX_PLATFORMS=cpu python benchmarks/sampler_fingerprints.py > before.txt   # then after the change
  diff before.txt after.txt

Each line: family, policy, the hash of the images (float32 bytes), the hash of the token ids (VAR).
"""
from __future__ import annotations

import hashlib

import jax
import numpy as np

from accel import ECARConditionCache, FastVAR, LazyMAR, LazyVAR, SparVAR, compose
from accel.specs import BASELINES
from configs import ecar as ecar_configs
from configs import mar as mar_configs
from configs import var as var_configs
from sampling import family_from_config

POLICIES = {
    'var': {'baseline': BASELINES['var'](),
            'fastvar': FastVAR(ratios=((4, 0.5), (8, 1.0)), cache_at=2),
            'lazyvar': LazyVAR(start=2, retention=(0.5, 0.25)),
            'sparvar': SparVAR(decision=4, sparse=(8,), group=16, sink_scales=2, topk=0.3),
            'fastvar+lazyvar': compose(FastVAR(ratios=((4, 0.5),), cache_at=2),
                                       LazyVAR(start=3, retention=(0.5,), pgd=False))},
    'mar': {'baseline': BASELINES['mar'](),
            'lazymar': LazyMAR(scaled=True, decoder=False, head_skip=(1,))},
    'ecar': {'baseline': BASELINES['ecar'](),
             'ecarcache': ECARConditionCache(interval=2)},
}
CONFIGS = {'var': (var_configs, dict(cfg=1.5, top_k=10, top_p=0.9)), 'mar': (mar_configs, dict(cfg=2.0, num_steps=6)),
           'ecar': (ecar_configs, dict(cfg=1.5, num_steps=6))}


def digest(x) -> str:
  return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()[:16]


def main():
  labels = np.array([3, 1, 4, 1], np.int32)
  for name, (module, overrides) in CONFIGS.items():
    family = family_from_config(module.get_config('tiny'), overrides=overrides, key=jax.random.key(7))
    for spec, policy in POLICIES[name].items():
      sample = family.make(policy)
      images, aux = sample(family.params, jax.random.key(11), labels, **family.opts)
      tokens = family.tokens(aux)
      print(name, spec, digest(images), digest(np.concatenate([np.ravel(t) for t in tokens])) if tokens else '-',
            flush=True)


if __name__ == '__main__':
  main()
