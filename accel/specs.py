"""Policies named on a command line: 'METHOD:PRESET', a preset's settings changed by '[field=value]'
(one each, a Python literal), several policies joined by '+' (composed, VAR only).

    policy_from_spec('fastvar:infinity_2b')              # FastVAR.preset('infinity_2b')
    policy_from_spec('lazymar:official', family='mar')   # LazyMAR.preset('official')
    policy_from_spec('lazymar:official[decoder_sizes=2]', family='mar')   # ... with decoder_sizes=2
    policy_from_spec('baseline', family='ecar')          # the unaccelerated E-CAR sampler
    split_specs('fastvar:var256,fastvar:infinity_2b[blocks=(3, 4)]')   # a command line's list of specs
"""
from __future__ import annotations

import ast
import dataclasses

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
  name, _, rest = preset.partition('[')
  policy = cls.preset(name)
  if not rest:
    return policy
  return dataclasses.replace(policy, **_settings(spec, cls, '[' + rest),
                             source=f"{preset}: {policy.source.partition(': ')[2]}")


def _settings(spec: str, cls, text: str) -> dict:
  """'[field=value][field=value]...' -> {field: value} of the dataclass cls's fields."""
  bad = ValueError(f"policy {spec!r}: settings must be '[field=value]' each, got {text!r}")
  fields = {f.name for f in dataclasses.fields(cls) if f.init and f.compare and f.name != 'source'}
  out = {}
  for group in _bracketed(text, bad):
    field, eq, value = group.partition('=')
    if not eq or not field.isidentifier():
      raise bad
    if field not in fields:
      raise ValueError(f'policy {spec!r}: {cls.__name__} has no setting {field!r}; known: {sorted(fields)}')
    try:
      out[field] = ast.literal_eval(value)
    except (ValueError, SyntaxError) as e:
      raise ValueError(f'policy {spec!r}: {field}={value!r} is not a Python literal') from e
  return out


def _bracketed(text: str, error: Exception) -> list[str]:
  """'[a][b]...' -> ['a', 'b', ...], the brackets and parentheses inside each group kept; anything
  else raises `error`."""
  groups, depth, start = [], 0, 0
  for i, c in enumerate(text):
    if depth == 0 and c != '[':
      raise error
    depth += (c in '([{') - (c in ')]}')
    if depth == 0:
      if c != ']':
        raise error
      groups.append(text[start + 1:i])
      start = i + 1
  if depth:
    raise error
  return groups


def _top_level(text: str, sep: str, error: Exception) -> list[str]:
  """text split at each `sep` outside brackets and parentheses; unbalanced ones raise `error`."""
  parts, depth, start = [], 0, 0
  for i, c in enumerate(text):
    depth += (c in '([{') - (c in ')]}')
    if depth < 0:
      raise error
    if c == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  if depth:
    raise error
  return parts + [text[start:]]


def split_specs(text: str) -> list[str]:
  """Comma-separated specs -> [spec, ...], a comma inside a setting's value ('[blocks=(3, 4)]') kept."""
  return [s.strip() for s in _top_level(text, ',', ValueError(f'unbalanced brackets in policies {text!r}'))
          if s.strip()]


def policy_from_spec(spec: str, family: str = 'var'):
  """The policy a spec names for a sampler of `family` ('var', 'mar', 'ecar'); 'a+b' composes a and b."""
  if family not in BASELINES:
    raise ValueError(f'unknown sampler family {family!r}; known: {sorted(BASELINES)}')
  unbalanced = ValueError(f'policy {spec!r}: unbalanced brackets')
  parts = [_one(s.strip(), family) for s in _top_level(spec, '+', unbalanced)]
  if len(parts) > 1 and family != 'var':
    raise ValueError(f"policy {spec!r}: '+' composes next-scale (VAR) policies only")
  return parts[0] if len(parts) == 1 else compose(*parts)
