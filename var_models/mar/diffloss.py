"""MAR's DiffLoss head: the small AdaLN MLP denoiser and its loss / sampler.

Param tree of `SimpleMLPAdaLN` (torch name in brackets, flax Dense kernels are [in, out]):
  input_proj                      [input_proj]
  cond_embed                      [cond_embed]
  time_embed/mlp_0, mlp_2         [time_embed.mlp.0, .2]  (`var_models.nn.timestep.TimestepEmbedder`)
  res_blocks_{i}/in_ln            [res_blocks.{i}.in_ln]  (LayerNorm scale/bias)
  res_blocks_{i}/mlp_0, mlp_2     [res_blocks.{i}.mlp.0, .2]
  res_blocks_{i}/adaLN_modulation_1  [res_blocks.{i}.adaLN_modulation.1]
  final_layer/adaLN_modulation_1  [final_layer.adaLN_modulation.1]
  final_layer/linear              [final_layer.linear]
"""
from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from var_models.mar.gaussian_diffusion import GaussianDiffusion, SampleModelFn, create_diffusion
from var_models.nn.blocks import (adaln_ahead_pays, concat_dense, merged_dense, merged_modulations, modulate,
                                  split_modulations)
from var_models.nn.timestep import TimestepEmbedder

Array = jax.Array

_xavier = nn.initializers.xavier_uniform()
_zeros = nn.initializers.zeros


def _dense(features: int, name: str, dtype, kernel_init=_xavier) -> nn.Dense:
  return nn.Dense(features, kernel_init=kernel_init, bias_init=_zeros, dtype=dtype, name=name)


class ResBlock(nn.Module):
  """x + gate * MLP(modulate(LN(x), scale, shift)), (shift, scale, gate) from y. [N, w] -> [N, w]."""
  width: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, y: Array, mod: Optional[Array] = None, hooks: Optional['HeadHooks'] = None,
               index: int = 0, state: Any = None):
    """mod [N, 3w]: this block's merged adaLN output when the caller computed it (`merged_adaln`:
    the shift through mlp_0's kernel, the scale, the gate), or [N, w], its gate alone, for hooks
    that never run the MLP (`HeadHooks.needs_mlp`); None: the block's own adaLN Linear.
    With `hooks` (a sampling policy's, see `HeadHooks`) returns (x, state), else x."""
    fc1 = _dense(self.width, 'mlp_0', self.dtype)
    if mod is None:
      shift, scale, gate = jnp.split(_dense(3 * self.width, 'adaLN_modulation_1', self.dtype, _zeros)(nn.silu(y)), 3, axis=-1)
      first = lambda h: fc1(modulate(h, scale, shift))
    elif mod.shape[-1] == self.width:
      gate = mod
    else:   # (h * (1 + scale) + shift) @ W + b as (h * (1 + scale)) @ W + b + shift @ W
      shift_w, scale, gate = jnp.split(mod, 3, axis=-1)
      first = lambda h: fc1(h * (1 + scale)) + shift_w

    def mlp():
      h = nn.LayerNorm(epsilon=1e-6, use_fast_variance=False, dtype=self.dtype, name='in_ln')(x)
      return _dense(self.width, 'mlp_2', self.dtype)(nn.silu(first(h)))

    if hooks is None:
      return x + gate * mlp()
    return hooks.res_block(index, x, gate, mlp, state)


class HeadHooks:
  """One DiffLoss sampling step's hooks on the res blocks (a sampling policy's head cache, e.g.
  LazyMAR's). The base runs every block."""
  skipped: tuple[int, ...] = ()   # blocks that do not run at all: `skip` makes their output
  needs_mlp: bool = True          # False: `res_block` never calls mlp(), so only the adaLN gates are computed

  def skip(self, index: int, x: Array, state: Any) -> tuple[Array, Any]:
    """The output of skipped block `index` from its input x [N, w]."""
    raise NotImplementedError(f'{type(self).__name__} skips block {index} but does not say how')

  def res_block(self, index: int, x: Array, gate: Array, mlp, state: Any) -> tuple[Array, Any]:
    """Block `index`'s output from its input x [N, w], its adaLN gate [N, w] and `mlp()` (the
    block's LN, modulation and MLP of x [N, w], computed only if called)."""
    return x + gate * mlp(), state


class FinalLayer(nn.Module):
  """Linear(modulate(LN(x), scale, shift)) with a non-affine LN. [N, w] -> [N, out]."""
  width: int
  out_channels: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, y: Array, mod: Optional[Array] = None) -> Array:
    if mod is None:
      mod = _dense(2 * self.width, 'adaLN_modulation_1', self.dtype, _zeros)(nn.silu(y))
    shift, scale = jnp.split(mod, 2, axis=-1)
    h = nn.LayerNorm(epsilon=1e-6, use_scale=False, use_bias=False, use_fast_variance=False,
                     dtype=self.dtype)(x)
    return _dense(self.out_channels, 'linear', self.dtype, _zeros)(modulate(h, scale, shift))


def merged_adaln(params, blocks: Optional[Sequence[int]] = None, gates_only: bool = False) -> tuple[Array, Array]:
  """The adaLN Linears of the res blocks `blocks` (default: all) and of the final layer, concatenated
  (they all read the same SiLU(y)): (kernel [w, (3 len(blocks) + 2) w], bias), see `concat_dense`.
  A block's shift columns come multiplied by its mlp_0 kernel (`ResBlock` adds shift @ W after
  mlp_0 rather than shift before it: the same map, and a sampling step has no separate add of the
  shift, which XLA could not fuse into the LayerNorm's kernel).
  gates_only: of the blocks' Linears only the gate's columns (kernel [w, (len(blocks) + 2) w])."""
  if blocks is None:
    blocks = range(sum(1 for k in params if k.startswith('res_blocks_')))
  layers = []
  for i in blocks:   # (shift, scale, gate) are the Linear's three equal column blocks
    layer, w = params[f'res_blocks_{i}']['adaLN_modulation_1'], params[f'res_blocks_{i}']['mlp_0']['kernel']
    c = w.shape[0]
    through = lambda a: jnp.matmul(a[..., :c], w, precision=jax.lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32).astype(a.dtype)
    layers.append({k: v[..., 2 * c:] for k, v in layer.items()} if gates_only else
                  {k: jnp.concatenate([through(v), v[..., c:]], axis=-1) for k, v in layer.items()})
  return concat_dense(layers + [params['final_layer']['adaLN_modulation_1']])


class SimpleMLPAdaLN(nn.Module):
  """DiffLoss denoiser: x [N, in], t [N] (original diffusion step), c [N, z] -> [N, out] float32,
  out = (eps, variance values). Init as the official: xavier-uniform Linears with zero bias,
  normal(0.02) time-embedding weights, zero adaLN modulations and output layer."""
  model_channels: int
  z_channels: int
  num_res_blocks: int
  in_channels: int = 16
  out_channels: int = 32
  dtype: Any = jnp.float32

  def setup(self):
    w, dt = self.model_channels, self.dtype
    self.time_embed = TimestepEmbedder(w, dt)
    self.cond_embed = _dense(w, 'cond_embed', dt)
    self.input_proj = _dense(w, 'input_proj', dt)
    self.res_blocks = [ResBlock(w, dt) for _ in range(self.num_res_blocks)]
    self.final_layer = FinalLayer(w, self.out_channels, dt)

  def __call__(self, x: Array, t: Array, c: Array, adaln: Optional[tuple[Array, Array]] = None,
               ahead: Optional[Array] = None) -> Array:
    """adaln: `merged_adaln(params)`, to run every adaLN Linear as one GEMM (the same values);
    ahead: that GEMM's output for this step's (t, c) [N, sum], computed before the sampling loop
    (`adaln_outputs`): t and c are then not read again."""
    return self._trunk(x, t, c, adaln, None, None, ahead)[0]

  def forward_hooked(self, x: Array, t: Array, c: Array, adaln: tuple[Array, Array], hooks: HeadHooks,
                     state: Any, ahead: Optional[Array] = None) -> tuple[Array, Any]:
    """`__call__` through a policy's `hooks`, carrying its `state`; adaln is `merged_adaln(params,
    blocks)` of the blocks that run (those not in hooks.skipped), ahead its output as in
    `__call__`. -> (out [N, out], state)."""
    return self._trunk(x, t, c, adaln, hooks, state, ahead)

  def adaln_outputs(self, t: Array, c: Array, adaln: tuple[Array, Array]) -> Array:
    """The merged adaLN GEMM of every step at once: t [S] (each step's original diffusion step), c
    [N, z] -> [S, N, sum], what a step at t on the rows c computes, by the same operations on each
    (step, row). Its weights, most of the head's bytes, are then read once for S steps instead of
    once a step."""
    (s,), (n, _) = t.shape, c.shape
    y = self.time_embed(jnp.repeat(t, n)).reshape(s, n, -1) + self.cond_embed(jnp.broadcast_to(c, (s,) + c.shape))
    return merged_dense(y, adaln, self.dtype)

  def _trunk(self, x, t, c, adaln, hooks, state, ahead):
    h = self.input_proj(x)
    y = None if ahead is not None else self.time_embed(t) + self.cond_embed(c)
    skipped = () if hooks is None else hooks.skipped
    run = [i for i in range(self.num_res_blocks) if i not in skipped]
    mods = [None] * (len(run) + 1)
    width = (3 if hooks is None or hooks.needs_mlp else 1) * self.model_channels
    if ahead is not None:
      mods = split_modulations(ahead, width, len(run))
    elif adaln is not None:
      mods = merged_modulations(y, adaln, width, len(run), self.dtype)
    mod_of = dict(zip(run, mods))
    for i, block in enumerate(self.res_blocks):
      if hooks is None:
        h = block(h, y, mod_of[i])
      elif i in skipped:
        h, state = hooks.skip(i, h, state)
      else:
        h, state = block(h, y, mod_of[i], hooks, i, state)
    return self.final_layer(h, y, mods[-1]).astype(jnp.float32), state

  def forward_with_cfg(self, x: Array, t: Array, c: Array, guidance,
                       adaln: Optional[tuple[Array, Array]] = None, ahead: Optional[Array] = None) -> Array:
    """Batch = [cond; uncond] halves. Both halves are denoised from the cond half's x; both
    get eps = uncond + guidance * (cond - uncond); the variance channels pass through per row."""
    half = x[: x.shape[0] // 2]
    out = self(jnp.concatenate([half, half], axis=0), t, c, adaln, ahead)
    eps, rest = out[:, :self.in_channels], out[:, self.in_channels:]
    cond, uncond = jnp.split(eps, 2, axis=0)
    guided = uncond + guidance * (cond - uncond)
    return jnp.concatenate([jnp.concatenate([guided, guided], axis=0), rest], axis=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffLossConfig:
  """DiffLoss sizes (MAR-B: z_channels 768, width 1024, depth 6) and its two processes."""
  target_channels: int = 16
  z_channels: int
  width: int
  depth: int
  num_sampling_steps: Union[str, int] = '100'
  train_steps: int = 1000
  dtype: Any = jnp.float32

  def make_net(self) -> SimpleMLPAdaLN:
    return SimpleMLPAdaLN(model_channels=self.width, z_channels=self.z_channels, num_res_blocks=self.depth,
                          in_channels=self.target_channels, out_channels=2 * self.target_channels,
                          dtype=self.dtype)

  def train_diffusion(self) -> GaussianDiffusion:
    return create_diffusion(None, 'cosine', self.train_steps)

  def gen_diffusion(self) -> GaussianDiffusion:
    return create_diffusion(self.num_sampling_steps, 'cosine', self.train_steps)


def init_diffloss(cfg: DiffLossConfig, key: Array) -> dict:
  """Official-init params of `cfg.make_net()`."""
  c = cfg.target_channels
  x, t, z = jnp.zeros((1, c)), jnp.zeros((1,), jnp.int32), jnp.zeros((1, cfg.z_channels))
  return cfg.make_net().init(key, x, t, z)['params']


def diffloss_loss(net: SimpleMLPAdaLN, params, target: Array, z: Array, mask: Optional[Array], key: Array,
                  *, repeats: int = 1, diffusion: Optional[GaussianDiffusion] = None) -> Array:
  """Scalar DiffLoss of target [N, C] under condition z [N, Cz]: every row denoised `repeats` times
  (the official's diffusion_batch_mul copies, repeat-major), each with its own t ~ U{0..T-1} and
  eps ~ N(0, I); per-row MSE + VB, averaged over the repeats and the rows where mask [N] is set
  (sum(loss * mask) / sum(mask)), or over all rows without a mask. The repeats are a vmapped axis,
  not copies of the rows: a batch split over devices stays split (a copied row axis cannot be).
  diffusion defaults to the full 1000-step cosine process."""
  diffusion = diffusion or create_diffusion(None)
  k_t, k_noise = jax.random.split(key)
  t = jax.random.randint(k_t, (repeats, target.shape[0]), 0, diffusion.num_timesteps)
  noise = jax.random.normal(k_noise, (repeats,) + target.shape, jnp.float32)
  x0 = target.astype(jnp.float32)
  model_fn = lambda x, tm: net.apply({'params': params}, x, tm, z)
  loss = jax.vmap(lambda tr, nr: diffusion.training_losses(model_fn, x0, tr, nr)['loss'])(t, noise)
  if mask is None:
    return jnp.mean(loss)
  mask = jnp.broadcast_to(mask.astype(loss.dtype), loss.shape)
  return jnp.sum(loss * mask) / jnp.sum(mask)


def adaln_ahead(net: SimpleMLPAdaLN, params, z: Array, adaln: tuple[Array, Array], diffusion: GaussianDiffusion,
                steps: Optional[Sequence[int]] = None) -> Optional[Array]:
  """The merged adaLN outputs of the loop steps `steps` (default: all; loop step i is t = T-1-i) on
  the rows z [N, Cz] -> [len(steps), N, sum], or None where that does not pay (`adaln_ahead_pays`)."""
  if not adaln_ahead_pays(z.shape[0]):
    return None
  steps = range(diffusion.num_timesteps) if steps is None else steps
  t = diffusion.model_timesteps(jnp.asarray([diffusion.num_timesteps - 1 - i for i in steps], jnp.int32))
  return net.apply({'params': params}, t, z, adaln, method=SimpleMLPAdaLN.adaln_outputs)


def diffloss_model_fn(net: SimpleMLPAdaLN, params, z: Array, guidance, guided: bool,
                      adaln: Optional[tuple[Array, Array]] = None,
                      diffusion: Optional[GaussianDiffusion] = None) -> SampleModelFn:
  """model_fn(x, t_model, i) for `p_sample_loop`: the plain net, or with `guided` (z = [cond;
  uncond]) `forward_with_cfg` at the (possibly traced) guidance. adaln: `merged_adaln(params)`,
  merged by a caller outside its own loop; default: merged here, outside the loop that calls
  model_fn. With the loop's `diffusion`, loop step i takes its adaLN outputs from `adaln_ahead`,
  computed here, before the loop, where it applies."""
  adaln = merged_adaln(params) if adaln is None else adaln
  ahead = None if diffusion is None else adaln_ahead(net, params, z, adaln, diffusion)
  step = lambda i: None if ahead is None else ahead[i]
  if guided:
    return lambda x, t, i: net.apply({'params': params}, x, t, z, guidance, adaln, step(i),
                                     method=SimpleMLPAdaLN.forward_with_cfg)
  return lambda x, t, i: net.apply({'params': params}, x, t, z, adaln, step(i))


class HeadCache:
  """What a sampling policy does in one guided DiffLoss sampling loop (e.g. LazyMAR's head cache).
  Every loop step i (t = T-1-i) has a static *kind* (`kinds`); per kind the policy says whether the
  unconditional half runs (`uncond`), which `HeadHooks` the res blocks get, and how the guided eps
  is made (`guide`, which may cache); its `state` lives for one loop. The base caches nothing."""

  def kinds(self, num_steps: int) -> tuple[Hashable, ...]:
    return (None,) * num_steps

  def init_state(self, rows: int, width: int, depth: int, channels: int) -> Any:
    return None

  def uncond(self, kind: Hashable) -> bool:
    return True

  def hooks(self, kind: Hashable) -> HeadHooks:
    return HeadHooks()

  def guide(self, kind: Hashable, eps_c: Array, eps_u: Optional[Array], guidance, state: Any):
    """The guided eps [R, C] from the conditional eps_c and the unconditional eps_u [R, C] (None
    when the step skipped that half) -> (eps, state)."""
    return eps_u + guidance * (eps_c - eps_u), state


def head_adaln(net: SimpleMLPAdaLN, params, cache: Optional[HeadCache], num_steps: int) -> dict:
  """{kind: `merged_adaln` of the blocks its steps run} for a sampling loop of num_steps through
  `cache` ({None: every block} without one), for a sampler to merge once, outside its loops."""
  if cache is None:
    return {None: merged_adaln(params)}
  run = lambda kind: [i for i in range(net.num_res_blocks) if i not in cache.hooks(kind).skipped]
  return {kind: merged_adaln(params, run(kind), gates_only=not cache.hooks(kind).needs_mlp)
          for kind in dict.fromkeys(cache.kinds(num_steps))}


def conditional_draws(key: Array, rows: int, channels: int):
  """The random draws `diffloss_sample` makes from `key` on 2 x rows guided rows, the conditional
  rows' only: (x_T [rows, C], noise_fn(i) -> loop step i's noise [rows, C]), for
  `diffloss_sample_cached` to sample what the plain loop would."""
  k_init, k_loop = jax.random.split(key)
  x_t = jax.random.normal(k_init, (rows, channels), jnp.float32)
  return x_t, lambda i: jax.random.normal(jax.random.fold_in(k_loop, i), (2 * rows, channels), jnp.float32)[:rows]


def diffloss_sample_cached(net: SimpleMLPAdaLN, params, z: Array, x_T: Array, noise_fn, temperature, guidance,
                           cache: HeadCache, diffusion: GaussianDiffusion, adaln: Optional[dict] = None) -> Array:
  """Guided sampling through a policy's `cache`: z = [cond; uncond] [2R, Cz], x_T [R, C]. Only
  the conditional rows' x is carried: `forward_with_cfg` denoises both halves from it and the
  unconditional rows' samples are never used. noise_fn(i) -> [R, C]; adaln: `head_adaln` (default:
  merged here). Returns the tokens [R, C]."""
  r, c = x_T.shape
  kinds = cache.kinds(diffusion.num_timesteps)
  adaln = adaln or head_adaln(net, params, cache, diffusion.num_timesteps)
  # Each kind's adaLN outputs at its own steps, before the loop (`adaln_ahead`): at[i] is step i's
  # row among its kind's.
  steps_of = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in adaln}
  ahead = {kind: adaln_ahead(net, params, z if cache.uncond(kind) else z[:r], adaln[kind], diffusion, steps)
           for kind, steps in steps_of.items()}
  at = jnp.asarray([steps_of[k].index(i) for i, k in enumerate(kinds)], jnp.int32)

  def model_fn(kind, x, t, i, state):
    both = cache.uncond(kind)
    x, t, cond = (jnp.concatenate([x, x]), jnp.concatenate([t, t]), z) if both else (x, t, z[:r])
    out, state = net.apply({'params': params}, x, t, cond, adaln[kind], cache.hooks(kind), state,
                           None if ahead[kind] is None else ahead[kind][at[i]], method=SimpleMLPAdaLN.forward_hooked)
    eps, state = cache.guide(kind, out[:r, :c], out[r:, :c] if both else None, guidance, state)
    return jnp.concatenate([eps, out[:r, c:]], axis=1), state

  state = cache.init_state(r, net.model_channels, net.num_res_blocks, c)
  return diffusion.p_sample_loop_stepped(kinds, model_fn, x_T, noise_fn, temperature, state)[0]


def diffloss_sample(net: SimpleMLPAdaLN, params, z: Array, key: Array, temperature, guidance, *,
                    guided: bool, diffusion: Optional[GaussianDiffusion] = None,
                    adaln: Optional[tuple[Array, Array]] = None) -> Array:
  """z [N, Cz] -> token latents [N, C] by ancestral sampling (default: 100 respaced steps).
  guided (static) means z = [cond; uncond] halves sharing one initial noise and guidance
  applies; all N rows come back (the uncond half is the caller's to drop). temperature scales
  only the per-step noise, as the official does. adaln: `merged_adaln(params)` (default: merged
  here)."""
  diffusion = diffusion or create_diffusion('100')
  k_init, k_loop = jax.random.split(key)
  n = z.shape[0] // 2 if guided else z.shape[0]
  x_T = jax.random.normal(k_init, (n, net.in_channels), jnp.float32)
  if guided:
    x_T = jnp.concatenate([x_T, x_T], axis=0)
  model_fn = diffloss_model_fn(net, params, z, guidance, guided, adaln, diffusion)
  return diffusion.p_sample_loop(model_fn, x_T, k_loop, temperature)
