"""Alike blocks run as one `lax.scan` over their stacked parameters.

The parameters stay where they are, one subtree per block (`blocks_0`, `blocks_1`, ...), so
checkpoints and converters see the same tree, and the program holds one block where it held
`len(blocks)`: it compiles once, not once per block. The scan reads the blocks' parameters
stacked on a leading layer axis: `stack_blocks` stacks a module list once, where parameters are
loaded (a sampler's `prepare`), as `NAME_stacked` in place of `NAME_0`, `NAME_1`, ...; inside the
trace `block_views` shows the modules their blocks again (slices of the stack, which XLA computes
only where a block runs alone), and `stack_of` hands a scan the stack. Parameters not stacked
beforehand are stacked inside the traced function, which reads and writes every block's
parameters on every call (8 ms of the Infinity-2B-shape sampler's 240 at batch 1, H200). A scan
inside a loop (MAR's iterations) takes its stack from outside the loop (`stacked`): XLA does not
hoist the stacking out of a loop's conditional branches, and would restack every weight at every
step.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

import pallas_kernels as pk
from var_models.nn import tokens as tok
from var_models.nn.blocks import DenseGELU


def stack_layers(trees: Sequence[Any]) -> Any:
  """Per-layer pytrees of one structure -> one pytree whose leaves are stacked on a leading layer axis."""
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


STACKED = '_stacked'   # NAME_stacked: the stacked parameters of the module list NAME (NAME_0, NAME_1, ...)


def stack_blocks(tree: Any, names: Sequence[str]) -> Any:
  """`tree` (nested dicts of parameters) with each module list named in `names` (subtrees NAME_0,
  NAME_1, ... at any depth, two or more) replaced by NAME_stacked, their leaves stacked on a
  leading layer axis (`stack_layers`). Made once, where the parameters are loaded."""
  if not isinstance(tree, Mapping):
    return tree
  out = {k: stack_blocks(v, names) for k, v in tree.items()}
  for name in names:
    n = next(i for i in itertools.count() if f'{name}_{i}' not in out)
    if n >= 2:
      out[name + STACKED] = stack_layers([out.pop(f'{name}_{i}') for i in range(n)])
  return out


def block_views(tree: Any) -> Any:
  """Inside a trace: `tree` with each NAME_stacked (`stack_blocks`) kept and seen again as its
  blocks NAME_0, NAME_1, ... (slices of it), which the modules bind; XLA computes a slice only
  where its block runs alone."""
  if not isinstance(tree, Mapping):
    return tree
  out = {k: block_views(v) for k, v in tree.items()}
  for key, stack in tree.items():
    if key.endswith(STACKED):
      depth = jax.tree.leaves(stack)[0].shape[0]
      out.update({f'{key[:-len(STACKED)]}_{i}': jax.tree.map(lambda a, i=i: a[i], stack) for i in range(depth)})
  return out


def stack_of(blocks: Sequence[nn.Module]) -> Any:
  """The parameters of `blocks` (bound submodules NAME_0, NAME_1, ... of one parent, in order)
  stacked on a leading layer axis: the parent's NAME_stacked where its parameters hold it
  (`stack_blocks`), else stacked here."""
  name = blocks[0].name.rpartition('_')[0]
  held = blocks[0].parent.variables.get('params', {}).get(name + STACKED) if blocks[0].parent else None
  if held is not None and jax.tree.leaves(held)[0].shape[0] == len(blocks):
    return held
  return stack_layers([b.variables['params'] for b in blocks])


def scan_runs(groups: Sequence[Optional[Hashable]]) -> list[list[int]]:
  """The blocks 0..len(groups)-1 in order, grouped: maximal runs of consecutive blocks of one
  group key (static, hashable); a block whose key is None runs alone."""
  runs: list[list[int]] = []
  for i, g in enumerate(groups):
    if g is not None and runs and groups[runs[-1][-1]] == g:
      runs[-1].append(i)
    else:
      runs.append([i])
  return runs


def hooks_group(hooks) -> Optional[Hashable]:
  """A block's key for `scan_runs` from its hooks (a `BlockHooks` or None): blocks without hooks
  compute alike (('plain',)); a hooked block, its hooks' `scan_group()` (None: it runs alone)."""
  return ('plain',) if hooks is None else hooks.scan_group()


def cache_runs(hooks: Optional[Sequence[Any]], lengths: Sequence[int]) -> list[list[int]]:
  """`scan_runs` of blocks with KV caches: maximal runs of consecutive blocks that compute alike
  (`hooks_group` of hooks[i], a `BlockHooks` or None; hooks None: no block has any) and whose
  caches hold the same length (lengths[i]); a block whose hooks have no group runs alone."""
  def group(i):
    g = hooks_group(None if hooks is None else hooks[i])
    return None if g is None else (g, lengths[i])
  return scan_runs([group(i) for i in range(len(lengths))])


def scan_blocks(blocks: Sequence[nn.Module], layers: Sequence[int], carry: Any, xs: Any,
                call: Callable[[nn.Module, jax.Array, Any, Any], tuple[Any, Any]],
                stacked: Any = None, train: bool = False) -> tuple[Any, Any]:
  """carry through blocks[layers[0]], blocks[layers[1]], ... (consecutive) -> (carry, ys):
  call(block, i, carry, x_j) -> (carry, y_j) for each, where i = layers[j] (traced: the loop's
  counter, which lets XLA read a layer's slice of the stack in place), x_j is the j-th slice of
  `xs` and ys the y_j stacked (pytrees of arrays with a leading axis of len(layers)). `blocks`:
  bound submodules of one class and configuration (a deterministic call may differ in what it
  ignores, e.g. drop-path rates).

  Runs one `lax.scan`; `call` is traced once, on a copy of blocks[0] bound to each layer's
  parameters (`stacked`, or `stack_of(blocks)`: all of `blocks`, whichever `layers` run). Sampling
  (`train` False) indexes the stack at i and hands the dense layers their stacked weights
  (`_in_place`); `train` scans the run's slice of the stack as an input instead, so that the
  parameters' gradients come out as the scan's stacked outputs rather than a stack-sized sum carried
  through every layer."""
  kinds = {type(b) for b in blocks}
  if len(kinds) != 1:
    raise ValueError(f'scan_blocks: the blocks must be of one class, got {sorted(k.__name__ for k in kinds)}')
  if list(layers) != list(range(layers[0], layers[0] + len(layers))):
    raise ValueError(f'scan_blocks: the layers must be consecutive, got {list(layers)}')
  if stacked is None:
    stacked = stack_of(blocks)
  body, first = blocks[0].clone(parent=None), layers[0]

  def sampling_step(ic, x):
    i, c = ic
    params = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), stacked)
    with nn.intercept_methods(_in_place(stacked, i)):
      c, y = call(body.bind({'params': params}), i, c, x)
    return (i + 1, c), y

  def training_step(ic, layer):
    (i, c), (params, x) = ic, layer
    c, y = call(body.bind({'params': params}), i, c, x)
    return (i + 1, c), y
  if train:
    run_params = jax.tree.map(lambda a: a[first:first + len(layers)], stacked)
    (_, carry), ys = jax.lax.scan(training_step, (jnp.int32(first), carry), (run_params, xs))
  else:
    (_, carry), ys = jax.lax.scan(sampling_step, (jnp.int32(first), carry), xs, length=len(layers))
  return carry, ys


def through_runs(blocks: Sequence[nn.Module], runs: Sequence[Sequence[int]], hooks: Optional[Sequence[Any]],
                 x: Any, carry: Any, call: Callable[..., tuple[Any, Any]], stacked: Any = None,
                 train: bool = False) -> tuple[Any, Any]:
  """x [B, l, C] (an array or `tokens.Rows`) and `carry` through the blocks, run by run
  (`scan_runs`) -> (x, carry): call(block, i, hooks_i, x, carry, run) -> (x, carry) for each.
  A run of one calls its block as it is (i an int, hooks_i its hooks, run None); a longer run is
  one `scan_blocks` (over `stacked` when given) whose body sees x as one array (`tokens.dense`),
  i traced, hooks_i the run's first block's hooks `for_layer(i)` and `run` its layers (`train`:
  as `scan_blocks`). hooks: one per block (a `BlockHooks` or None), or None."""
  hook = lambda i: None if hooks is None else hooks[i]
  for run in runs:
    if len(run) == 1:
      x, carry = call(blocks[run[0]], run[0], hook(run[0]), x, carry, None)
      continue
    lead = hook(run[0])

    def body(block, i, xc, _, run=run, lead=lead):
      y, c = call(block, i, None if lead is None else lead.for_layer(i), *xc, run)
      return (tok.dense(y), c), None
    (x, carry), _ = scan_blocks(blocks, run, (tok.dense(x), carry), None, body, stacked, train)
  return x, carry


# The dense layers a scanned block may hold -> the activation after their affine map.
_DENSE = {nn.Dense: lambda y: y, DenseGELU: lambda y: jax.nn.gelu(y, approximate=True)}


def _dense(module: nn.Module, stacked: Any, layer: jax.Array, x: jax.Array) -> jax.Array:
  """A dense layer of the scanned block (`_DENSE`) with its weights in `stacked` at `layer`."""
  weights = stacked
  for name in module.path:
    weights = weights[name]
  dtype = module.dtype or jnp.result_type(x, weights['kernel'])
  if type(module) is DenseGELU and pk.dense_gelu_pays(x.size // x.shape[-1]):
    at = lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False).astype(dtype)
    return pk.dense_gelu(x.astype(dtype), at(weights['kernel']), at(weights['bias']))
  y = pk.layer_dense(x.astype(dtype), weights['kernel'], weights.get('bias'), layer)
  return _DENSE[type(module)](y)


def _in_place(stacked: Any, layer: jax.Array):
  """A flax method interceptor: the scanned block's dense layers (`_DENSE`), whose weights XLA would
  copy out of the stack for every layer, go through `pallas_kernels.layer_dense` at `layer` (the
  kernel, which reads them in place, up to its AUTO_MAX_ROWS rows on a GPU; XLA's GEMM, kept apart
  from its bias, elsewhere); a DenseGELU of as many rows as `pallas_kernels.dense_gelu` fuses (bound
  by its FLOPs, not its weights) takes the layer's slice to that kernel, as an unrolled block does.
  Other methods run as they are: XLA copies a scanned LayerNorm's scale and bias out of the stack
  (its LayerNorm fusions take no slice in place), two small copies that cost less than a kernel of
  its own (pallas_kernels/NOTES.md)."""
  def intercept(next_fun, args, kwargs, context):
    if type(context.module) not in _DENSE or context.method_name != '__call__':
      return next_fun(*args, **kwargs)
    return _dense(context.module, stacked, layer, args[0])
  return intercept
