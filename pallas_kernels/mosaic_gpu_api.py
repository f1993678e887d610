"""The two calls of Pallas' Mosaic GPU API whose form differs between jax 0.10 and 0.11.

- `load`: jax 0.10 takes the index as `plgpu.load`'s required second argument; 0.11 takes
  the ref already indexed (`ref.at[...]`) and warns on the argument.
- `compiler_params`: Warpgroup lowering semantics whatever jax's default. jax 0.11 made it the
  default (0.10's is Lane); the Hopper kernels were measured under it (NOTES.md), and pinning it
  makes the CPU's lowering tests on jax 0.10 lower what a GPU with jax 0.11 runs.
"""
from __future__ import annotations

import inspect

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

_INDEX = inspect.signature(plgpu.load).parameters.get('idx')
_LOAD_TAKES_INDEX = _INDEX is not None and _INDEX.default is inspect.Parameter.empty


def load(ref, *, layout=None, optimized: bool = True) -> jax.Array:
  """The whole of `ref` (indexed with `ref.at[...]`) as an array in `layout`."""
  args = (ref, ()) if _LOAD_TAKES_INDEX else (ref,)
  return plgpu.load(*args, layout=layout, optimized=optimized)


def compiler_params(**kwargs) -> plgpu.CompilerParams:
  """`plgpu.CompilerParams(**kwargs)` in Warpgroup lowering semantics."""
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **kwargs)
