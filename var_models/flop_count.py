"""Matmul FLOPs of a function, counted on its jaxpr (the same on every backend).

XLA's cost model does not serve on a GPU: the compiled program's count leaves out
the cuBLAS and cuDNN calls, and the lowered program's is empty there. The jaxpr
gives the convention of MFU and of the papers' FLOP counts: 2 FLOPs per
multiply-add of every `dot_general` and convolution, and of cuDNN's fused
attention (forward: q.k and p.v; backward: the four gradient matmuls, twice the
forward, as XLA's attention counts; cuDNN's recomputation of q.k is work, not
model FLOPs); element-wise work is left out. A `scan` counts
`length` times (a `fori_loop` with static bounds is one), a `while` of unknown
trip count once, a `cond` its costliest branch. `pallas_call`s are not counted.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
from jax.extend import core

_ATTENTION = {'dot_product_attention_fwd': 1.0, 'dot_product_attention_bwd': 2.0}


def flops(fn: Callable, *args: Any, **kwargs: Any) -> float:
  """FLOPs of one call fn(*args, **kwargs); args may be ShapeDtypeStructs."""
  return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr)


def jaxpr_flops(jaxpr: core.Jaxpr) -> float:
  return float(sum(_eqn_flops(e) for e in jaxpr.eqns))


def _eqn_flops(eqn) -> float:
  name, params = eqn.primitive.name, eqn.params
  if name == 'dot_general':
    (lhs_contract, _), _ = params['dimension_numbers']
    lhs = eqn.invars[0].aval.shape
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
  if name == 'conv_general_dilated':
    rhs, rhs_spec = eqn.invars[1].aval.shape, params['dimension_numbers'].rhs_spec
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs[d] for d in rhs_spec[1:])
  if name in _ATTENTION:
    b, lq, h, d = eqn.invars[0].aval.shape  # cuDNN's [B, L, H, D] layout
    lk = eqn.invars[1].aval.shape[1]
    return _ATTENTION[name] * 4.0 * b * h * lq * lk * d
  if name == 'scan':
    return params['length'] * jaxpr_flops(params['jaxpr'].jaxpr)
  if name == 'cond':
    return max(jaxpr_flops(br.jaxpr) for br in params['branches'])
  return sum(jaxpr_flops(j) for j in _sub_jaxprs(params))


def _sub_jaxprs(params: dict):
  for value in params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, core.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, core.Jaxpr):
        yield v
