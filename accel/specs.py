"""Policies named on a command line: 'METHOD:PRESET', several joined by '+' (composed).

    policy_from_spec('fastvar:infinity_2b')     # FastVAR.preset('infinity_2b')
    policy_from_spec('baseline')                # the unaccelerated sampler
"""
from __future__ import annotations

from accel.compose import compose
from accel.fastvar import FastVAR
from accel.lazyvar import LazyVAR
from var_models.var.policy import ScalePolicy

METHODS = {'fastvar': FastVAR, 'lazyvar': LazyVAR}


def _one(spec: str) -> ScalePolicy:
  if spec == 'baseline':
    return ScalePolicy()
  method, _, preset = spec.partition(':')
  if method not in METHODS or not preset:
    raise ValueError(f"policy {spec!r}: expected 'baseline' or METHOD:PRESET with METHOD one of "
                     f'{sorted(METHODS)}')
  return METHODS[method].preset(preset)


def policy_from_spec(spec: str) -> ScalePolicy:
  """The policy a spec names; 'a+b' composes a and b."""
  parts = [_one(s.strip()) for s in spec.split('+')]
  return parts[0] if len(parts) == 1 else compose(*parts)
