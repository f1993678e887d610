"""Policies named on a command line: 'METHOD:PRESET', several joined by '+' (composed, VAR only).

    policy_from_spec('fastvar:infinity_2b')              # FastVAR.preset('infinity_2b')
    policy_from_spec('lazymar:official', family='mar')   # LazyMAR.preset('official')
    policy_from_spec('baseline', family='ecar')          # the unaccelerated E-CAR sampler
"""
from __future__ import annotations

from accel.compose import compose
from accel.ecar_caches import ECARConditionCache
from accel.fastvar import FastVAR
from accel.lazymar import LazyMAR
from accel.lazyvar import LazyVAR
from accel.sparvar import SparVAR
from ecar.policy import StagePolicy
from var_models.mar.policy import MARPolicy
from var_models.var.policy import ScalePolicy

# method -> (the sampler family it accelerates, its class)
METHODS = {'fastvar': ('var', FastVAR), 'lazyvar': ('var', LazyVAR), 'sparvar': ('var', SparVAR),
           'lazymar': ('mar', LazyMAR),
           'ecarcache': ('ecar', ECARConditionCache)}
BASELINES = {'var': ScalePolicy, 'mar': MARPolicy, 'ecar': StagePolicy}


def _one(spec: str, family: str):
  if spec == 'baseline':
    return BASELINES[family]()
  method, _, preset = spec.partition(':')
  if method not in METHODS or not preset:
    raise ValueError(f"policy {spec!r}: expected 'baseline' or METHOD:PRESET with METHOD one of "
                     f'{sorted(METHODS)}')
  owner, cls = METHODS[method]
  if owner != family:
    raise ValueError(f'policy {spec!r} accelerates {owner.upper()} samplers, not a {family!r} config')
  return cls.preset(preset)


def policy_from_spec(spec: str, family: str = 'var'):
  """The policy a spec names for a sampler of `family` ('var', 'mar', 'ecar'); 'a+b' composes a and b."""
  if family not in BASELINES:
    raise ValueError(f'unknown sampler family {family!r}; known: {sorted(BASELINES)}')
  parts = [_one(s.strip(), family) for s in spec.split('+')]
  if len(parts) > 1 and family != 'var':
    raise ValueError(f"policy {spec!r}: '+' composes next-scale (VAR) policies only")
  return parts[0] if len(parts) == 1 else compose(*parts)
