"""E-CAR's class-conditional sampler, compiled whole.

    sample = make_sampler(ecar_cfg, num_steps=250)       # optionally policy=..., return_intermediates=True
    images, aux = sample(params, key, labels, cfg=1.5)

`params = {'ecar': ..., 'vae': ...}` (no 'vae' in pixel space);
images [B, H, W, 3] in [0, 1]. The batch is doubled for classifier-free guidance
([cond; uncond] with the null class). Stage loop in Python (each stage has its
own shapes): stage 0 starts from unit noise on the coarsest grid; stage s > 0
first gives the AR the end point of stage s - 1 (upsampled inside the model),
then jumps to its own start (`flow.renoise_jump`). The AR runs each stage's
tokens once, attending to its KV cache of the earlier stages (no mask needed);
its token map conditions the stage's denoiser, which integrates the flow from
local time 0 to 1 with `steps_per_stage[s]` Euler steps in a `lax.fori_loop`.
`num_steps` (an int) is split over the stages as evenly as possible, earlier
stages taking the remainder: 250 -> (84, 83, 83), the paper's "a third per stage".
With `return_intermediates`, aux holds per stage the AR token maps 'r' (the
conditional half, [B, N_s, C]) and the flow end points 'ends'. With `scan_blocks`
the AR's KV caches are stacked on a layer axis and its runs of alike blocks, and
each denoiser's blocks, are one `lax.scan` each (a denoiser's parameters stacked
once per stage, outside its flow loop): the program holds one block per run, not
per block. Arguments are checked before anything compiles.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from ecar import flow as flow_lib
from ecar.config import ECARConfig
from ecar.latents import decode
from ecar.layers import merged_adaln
from ecar.model import ECAR
from ecar.policy import BASELINE, FlowStep, StagePolicy
from var_models.nn import tokens as tok
from var_models.nn.attention import KVCache, LayerKVCaches
from var_models.nn.blocks import CUBLAS_GEMMS, adaln_ahead_pays, dense_params_in
from var_models.nn.checks import check_labels
from var_models.nn.policy import Binding, Halves
from var_models.nn.scan import block_views, stack_blocks

Array = jax.Array


def split_steps(total: int, num_stages: int) -> tuple[int, ...]:
  if total < num_stages:
    raise ValueError(f'num_steps must be >= the number of stages ({num_stages}), got {total}')
  q, r = divmod(total, num_stages)
  return tuple(q + (s < r) for s in range(num_stages))


def steps_per_stage(cfg: ECARConfig, num_steps: Union[int, Sequence[int]]) -> tuple[int, ...]:
  if isinstance(num_steps, (int, np.integer)):
    return split_steps(int(num_steps), cfg.num_stages)
  steps = tuple(int(n) for n in num_steps)
  if len(steps) != cfg.num_stages or any(n < 1 for n in steps):
    raise ValueError(f'num_steps must be an int or {cfg.num_stages} positive ints (one per stage), got {num_steps}')
  return steps


def check_sample_args(ecar_cfg: ECARConfig, labels, cfg: float) -> None:
  """The call's labels and guidance scale `cfg` (any finite value; 1 is no guidance)."""
  check_labels(labels, ecar_cfg.num_classes)
  if not np.isfinite(cfg):
    raise ValueError(f'cfg must be finite, got {cfg}')


class _Sampler:
  """Static parts (config, steps, policy); `__call__` is the public sampler."""

  def __init__(self, ecar_cfg: ECARConfig, steps: tuple[int, ...], policy: StagePolicy, return_intermediates: bool,
               scan_blocks: bool):
    self.cfg, self.steps, self.scan_blocks = ecar_cfg, steps, scan_blocks
    self.policy = policy.bind(Binding(model=ecar_cfg, schedule=steps, guided=True, scanned=scan_blocks))
    self.model, self.flow = ECAR(ecar_cfg), ecar_cfg.flow
    self.return_intermediates = return_intermediates
    self._denoisers = tuple(f'denoiser_{s}' for s in range(ecar_cfg.num_stages))
    self._jitted = jax.jit(self._sample, compiler_options=CUBLAS_GEMMS)

  def __call__(self, params, key: Array, labels, *, cfg: float = 1.5):
    return self._jitted(*self._checked(params, key, labels, cfg))

  def prepare(self, params) -> dict:
    """`params` as this sampler reads them, made once where they are loaded: the denoisers' Dense
    layers in the compute dtype, and scanned, the AR's and each denoiser's blocks stacked
    (`scan.stack_blocks`), both of which it would otherwise do on every call (the cast reads and
    writes ~2.8 GB at E-CAR-L, ~1 ms of a batch-1 call on an H200). Either form samples the same
    images."""
    ecar = {k: dense_params_in(v, self.cfg.dtype) if k in self._denoisers else v for k, v in params['ecar'].items()}
    return {**params, 'ecar': stack_blocks(ecar, ('blocks',)) if self.scan_blocks else ecar}

  def lower(self, params, key, labels, *, cfg: float = 1.5):
    """The lowered program (for compile time and FLOP accounting); params may be ShapeDtypeStructs."""
    return self._jitted.lower(*self._checked(params, key, labels, cfg))

  def arguments(self, params, key, labels, *, cfg: float = 1.5) -> tuple:
    """The arguments of the program `lower` returns, for the same call (to run it compiled)."""
    return self._checked(params, key, labels, cfg)

  def _checked(self, params, key, labels, cfg):
    check_sample_args(self.cfg, labels, cfg)
    if self.cfg.latent_space == 'vae' and params.get('vae') is None:
      raise ValueError("params['vae'] is required in latent space (config.latent_space='vae')")
    return params, key, jnp.asarray(labels, jnp.int32), jnp.float32(cfg)

  def _sample(self, all_params, key, labels, guidance):
    params, vae_params = all_params['ecar'], all_params.get('vae')
    cfg, b = self.cfg, labels.shape[0]
    dens = self._denoisers
    # A no-op on `prepare`d params: else the cast, once a call, outside the flow loops.
    v = {'params': block_views({**params, **{d: dense_params_in(params[d], cfg.dtype) for d in dens}})}
    cls2 = self.model.apply(v, jnp.concatenate([labels, jnp.full_like(labels, cfg.num_classes)]),
                            method=ECAR.class_embedding)
    head_dim = cfg.ar_width // cfg.ar_heads
    caches = LayerKVCaches.create if self.scan_blocks else KVCache.create_many
    kvs = caches(cfg.ar_depth, 2 * b, cfg.num_tokens, cfg.ar_heads, head_dim, cfg.dtype)
    state = self.policy.init_state(b)
    key, k_init = jax.random.split(key)
    x = jax.random.normal(k_init, (b, cfg.stage_sizes[0], cfg.stage_sizes[0], cfg.data_channels), jnp.float32)
    aux = {'r': [], 'ends': []}
    for s in range(cfg.num_stages):
      prev = None
      if s > 0:
        prev = jnp.concatenate([x, x])
        key, k_jump = jax.random.split(key)
        x = flow_lib.renoise_jump(self.flow, s, x, k_jump)
      r, kvs, state = self._ar_stage(v, s, self.model.apply(v, s, cls2, prev, method=ECAR.ar_inputs), kvs, state)
      cond = self.model.apply(v, s, r, method=ECAR.den_condition)
      adaln = merged_adaln(v['params'][dens[s]])
      ahead = self._adaln_ahead(v, s, cond, adaln)
      stacked = self.model.apply(v, s, method=ECAR.den_stacked_blocks) if self.scan_blocks else None
      x, state = jax.lax.fori_loop(
          0, self.steps[s], lambda i, c: self.euler_step(v, s, i, c[0], cond, guidance, c[1], adaln, ahead, stacked),
          (x, state))
      if self.return_intermediates:
        aux['r'].append(r[:b])
        aux['ends'].append(x)
    images = decode(cfg, vae_params, x)
    return images, (aux if self.return_intermediates else {})

  def _ar_stage(self, v, s: int, tokens: Array, kvs, state):
    """The AR on stage s's input tokens [2B, N_s, C] with the KV cache -> (r_s [2B, N_s, C], kvs, state)."""
    policy = self.policy
    sel, state = policy.select_input(s, tokens, state)
    hooks = policy.block_hooks(s, self.cfg.ar_depth)
    h, kvs, state = self.model.apply(v, tokens if sel is None else tok.gather(tokens, sel), kvs=kvs, hooks=hooks,
                                     state=state, method=ECAR.ar_blocks)
    r = self.model.apply(v, h, method=ECAR.ar_output)
    if sel is not None:
      r, state = policy.restore_output(s, r, sel, self.cfg.stage_tokens[s], state)
    return r, kvs, state

  def _adaln_ahead(self, v, s: int, cond: Array, adaln: tuple[Array, Array]) -> Optional[Array]:
    """Every Euler step's adaLN outputs of stage s on cond [2B, N_s, W] -> [n, 2B, N_s, sum],
    computed before the stage's loop where that pays (`blocks.adaln_ahead_pays`), else None."""
    if not adaln_ahead_pays(cond.shape[0] * cond.shape[1]):
      return None
    n = self.steps[s]
    ts = flow_lib.timestep(self.flow, s, jnp.arange(n, dtype=jnp.float32) / n)
    return self.model.apply(v, s, ts, cond, adaln, method=ECAR.den_adaln_outputs)

  def euler_step(self, v, s: int, i: Array, x: Array, cond: Array, guidance: Array, state: Any,
                 adaln: Optional[tuple[Array, Array]] = None, ahead: Optional[Array] = None, stacked: Any = None):
    """One Euler step of stage s: x [B, g, g, D] at local time i / n -> (x + v / n, state), with
    v = v_u + guidance * (v_c - v_u) from the policy's `guide`. cond [2B, N_s, W] is the denoiser's
    condition from the AR ([cond; uncond]); adaln its merged adaLN weights (`layers.merged_adaln`),
    ahead their outputs at every step of the stage [n, 2B, N_s, sum] (`_adaln_ahead`); stacked
    its blocks' stacked parameters, to scan them; guidance the call's `cfg`."""
    n, b = self.steps[s], x.shape[0]
    ts = flow_lib.timestep(self.flow, s, jnp.full((2 * b,), i, jnp.float32) / n)
    mods = None if ahead is None else ahead[i]
    vel = lambda xx, c, t, m: self.model.apply(v, s, xx, t, c, adaln, m, stacked, method=ECAR.den_velocity)

    def both():
      out = vel(jnp.concatenate([x, x]), cond, ts, mods)
      return out[:b], out[b:]

    halves = Halves(both=both, cond=lambda: vel(x, cond[:b], ts[:b], None if mods is None else mods[:b]))
    (v_cond, v_uncond), state = self.policy.guide(FlowStep(s, i), halves, state)
    return x + (v_uncond + guidance * (v_cond - v_uncond)) / n, state


def make_sampler(ecar_cfg: ECARConfig, *, num_steps: Union[int, Sequence[int]] = 250,
                 policy: Optional[StagePolicy] = None, return_intermediates: bool = False, scan_blocks: bool = False):
  """A pure, jit-compiled sampler `sample(params, key, labels, *, cfg) -> (images, aux)`.

  num_steps: Euler steps in all (split over the stages) or one count per stage. scan_blocks: the
  AR's runs of alike blocks and each denoiser's blocks as one `lax.scan` (see the module docstring).
  """
  return _Sampler(ecar_cfg, steps_per_stage(ecar_cfg, num_steps), policy or BASELINE, return_intermediates,
                  scan_blocks)
