"""MAR's class-conditional sampler (the official `sample_tokens`), compiled whole or as its parts.

    sample = make_mar_sampler(mar_cfg, vae_cfg, num_iter=64, guided=True)
    images, aux = sample(params, key, labels, cfg=3.0, cfg_schedule='linear', temperature=1.0)

`params = {'mar': ..., 'vae': ...}`; images [B, H, W, 3] in [0, 1]; aux['tokens']
[B, N, D] the sampled latent tokens (scaled as MAR sees them).

For comparisons with other implementations the call also takes the random draws
(`orders` [B, N], each sample's token order; `noises`, the head's initial and
per-step noise of every iteration, see `check_noises`) and `forced_tokens`
[num_iter, B, N, D] (teacher forcing: each iteration's sampled tokens are replaced
by these before the next one). A sampler made with record=True returns per
iteration (aux['iterations'], each [num_iter, ...]) the predicted positions
'pred' [B, P] (padded with N), the sampled tokens 'sampled' [B, P, D] and the
policy's caching decisions (`MARPolicy.record`).

Each iteration runs the MAE encoder on the known tokens and the decoder on all
positions, then the diffusion head samples the tokens the cosine schedule
predicts at that iteration, in a per-sample random order. Every per-iteration
count is static, so the iterations are one `lax.scan` over padded shapes:
  - the encoder runs on the buffer and the known positions only, as the official
    drops the others (`MAR.encode`'s gathered form): their count, static per
    iteration, is padded up to one of at most `encoder_sizes` lengths
    (`schedule.merge_sizes`, the fewest padded rows), the padding rows hidden as
    keys and dropped after. MAR's 64-iteration schedule averages 156 of its 320
    positions, so this halves the encoder's work against running every position;
    encoder_sizes=None runs every position, the unknown ones hidden as keys (the
    same outputs, one shape for every iteration), as do the iterations whose
    policy plan asks for it (`IterPlan.every_position`: LazyMAR's with its
    encoder cache, which holds every position's K/V);
  - the head samples P = max predicted-per-iteration rows; rows past an
    iteration's count are computed and discarded.
With guidance the batch is doubled ([cond; uncond(fake class)]), both halves
share the diffusion noise, eps = eps_u + s * (eps_c - eps_u), and s is 'linear'
(1 + (cfg - 1) * (N - mask_len) / N) or 'constant'.

A `policy` (`var_models.mar.policy.MARPolicy`; LazyMAR is one), bound when the
sampler is built to the config, its `MARSchedule` (`var_models.mar.schedule`) and
the guidance flag (and again for each batch size it is called with, `program`),
chooses per iteration which tokens each encoder and decoder block forwards, what
they attend to and restore from its caches, and whether the unconditional half
runs (its `guide` then makes it). The iterations run as one scan; with several
distinct static plans, its body switches to the iteration's model part (each plan
compiled once, however often the schedule alternates between them; inside it, to
the encoder's length), then to its head cache's sampling loop (each distinct cache
compiled once). The weights are cast to the compute dtype, stacked for the scanned
blocks and merged for the head's adaLN once per call, outside the loop. With
host_loop=True the consecutive iterations of one model part (a plan at one encoder length) and
one head cache run as a scan of their own, called in turn from the host (`var_models.mar.host_loop`):
no conditional, and a program per distinct part and head cache.
"""
from __future__ import annotations

import collections
import copy
import functools
import itertools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from var_models.mar.diffloss import (conditional_draws, diffloss_model_fn, diffloss_sample, diffloss_sample_cached,
                                     head_adaln)
from var_models.mar.gaussian_diffusion import create_diffusion
from var_models.mar.host_loop import HostLoop
from var_models.mar.model import MAR, MARConfig, diffloss_net, keep_indices, key_mask
from var_models.mar.policy import BASELINE, IterInfo, IterPlan, MARPolicy, Site, check_plans
from var_models.mar.schedule import MARSchedule, mask_schedule, merge_sizes
from var_models.nn import attention as attn_lib
from var_models.nn.blocks import dense_params_in
from var_models.nn.checks import check_labels
from var_models.nn.policy import Binding, Halves
from var_models.nn.scan import block_views, stack_blocks
from var_models.tokenizers.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig

Array = jax.Array
CFG_SCHEDULES = ('linear', 'constant')
# The parameters of MAR's compute-dtype Dense layers (cast once per call); its other Dense layers
# (z_proj, decoder_embed) compute in float32.
_CAST = ('encoder_blocks_', 'decoder_blocks_', 'diffloss')


def check_mar_sample_args(mar_cfg: MARConfig, labels, cfg: float, guided: bool, cfg_schedule: str,
                          temperature: float) -> None:
  """The call's labels and settings; `cfg` is the guidance scale (1 without guidance)."""
  check_labels(labels, mar_cfg.class_num)
  if cfg_schedule not in CFG_SCHEDULES:
    raise ValueError(f'unknown cfg_schedule {cfg_schedule!r}; expected one of {CFG_SCHEDULES}')
  if not np.isfinite(cfg) or (guided and cfg < 1):
    raise ValueError(f'cfg must be >= 1 with guidance, got {cfg}')
  if not guided and cfg != 1.0:
    raise ValueError(f'cfg {cfg} needs a sampler made with guided=True')
  if not temperature > 0:
    raise ValueError(f'temperature must be > 0, got {temperature}')


def check_noises(noises, num_iter: int, batch: int, max_pred: int, steps: int, channels: int) -> None:
  """noises = {'init': [num_iter, B, P, D] (each iteration's initial head noise of the conditional
  rows, repeated for the unconditional half), 'steps': [num_iter, T, 2, B, P, D] (each step's noise
  of the [cond, uncond] halves)}; row p < n_pred of an iteration is its p-th predicted position
  in ascending order, the other rows are padding."""
  want = {'init': (num_iter, batch, max_pred, channels), 'steps': (num_iter, steps, 2, batch, max_pred, channels)}
  got = {k: np.shape(noises[k]) if isinstance(noises, dict) and k in noises else None for k in want}
  if got != want:
    raise ValueError(f'noises must be {{name: shape}} {want}, got {got}')


def _ranks(order: Array) -> Array:
  """order [B, N] (a permutation per sample) -> rank [B, N] of every position in it."""
  b, n = order.shape
  return jnp.zeros_like(order).at[jnp.arange(b)[:, None], order].set(jnp.arange(n, dtype=order.dtype))


def _switch(ids: tuple[int, ...], i, branches: list):
  """branches[ids[i]]() for the iteration i (traced): one branch is called as it is."""
  if len(branches) == 1:
    return branches[0]()
  return jax.lax.switch(jnp.asarray(ids, jnp.int32)[i], branches)


class _MARSampler:
  def __init__(self, mar_cfg: MARConfig, vae_cfg: AutoencoderKLConfig, num_iter: int, guided: bool,
               num_diffusion_steps: Optional[int], policy: MARPolicy, record: bool, scan_blocks: bool,
               encoder_sizes: Optional[int], host_loop: bool):
    self.mar_cfg, self.guided, self.record, self.scan_blocks = mar_cfg, guided, record, scan_blocks
    self.model, self.vae = MAR(mar_cfg), AutoencoderKL(vae_cfg)
    self.head = diffloss_net(mar_cfg)
    self.diffusion = create_diffusion(num_diffusion_steps or mar_cfg.num_sampling_steps)
    self.schedule = MARSchedule(mask_schedule(mar_cfg.seq_len, num_iter), self.diffusion.num_timesteps)
    self.num_iter, self.encoder_sizes, self.unbound, self._programs = num_iter, encoder_sizes, policy, {}
    self.host_loop, self._compiled = host_loop, {}
    self._bind(None)
    self.vae_scale = vae_cfg.scaling_factor
    self._jitted = jax.jit(self._sample, static_argnames=('cfg_schedule',))

  def _bind(self, batch: Optional[int]) -> None:
    """Binds the policy (to `batch` samples a call, or None: not known) and sets what follows from
    it: `policy`, its `plans`, `head_caches`, the encoder's lengths, and the iterations' distinct
    parts, with each iteration's index into them (`trunk_ids`, `head_ids`): `heads` (head caches)
    and `trunks` (model parts: (plan, the encoder lengths it switches between, `length_ids`);
    with `host_loop` one length each: a trunk per plan and length)."""
    binding = Binding(self.mar_cfg, self.schedule, self.guided, scanned=self.scan_blocks, batch=batch)
    self.policy = policy = self.unbound.bind(binding)
    self.plans = policy.plan(self.num_iter)
    check_plans(self.plans, self.num_iter)
    self.head_caches = tuple(policy.head_cache(p) for p in self.plans)
    self.encoder_lengths = self._encoder_lengths(self.encoder_sizes)
    keys = [(p, n) if self.host_loop else p for p, n in zip(self.plans, self.encoder_lengths)]
    distinct = list(dict.fromkeys(keys))
    lengths = [sorted({n for k, n in zip(keys, self.encoder_lengths) if k == d}, key=lambda n: n or 0)
               for d in distinct]
    self.trunks = [(d[0] if self.host_loop else d, tuple(ls)) for d, ls in zip(distinct, lengths)]
    self.trunk_ids = tuple(distinct.index(k) for k in keys)
    self.length_ids = tuple(self.trunks[t][1].index(n) for t, n in zip(self.trunk_ids, self.encoder_lengths))
    self.heads = list(dict.fromkeys(self.head_caches))
    self.head_ids = tuple(self.heads.index(h) for h in self.head_caches)

  def program(self, batch: int) -> '_MARSampler':
    """This sampler with its policy bound to `batch` samples a call: what a call of that batch
    runs (a policy may plan by the batch, e.g. LazyMAR's `decoder_sizes='auto'`); made once per
    batch. The sampler's own `policy` and `plans` are the binding without a batch."""
    if batch not in self._programs:
      self._programs[batch] = copy.copy(self)
      self._programs[batch]._bind(batch)
    return self._programs[batch]

  def __call__(self, params, key, labels, *, cfg: float = 1.0, cfg_schedule: str = 'linear',
               temperature: float = 1.0, orders=None, noises=None, forced_tokens=None):
    args, static = self._checked(params, key, labels, cfg, cfg_schedule, temperature, orders, noises,
                                 forced_tokens)
    if not self.host_loop:
      return self._jitted(*args, **static)
    signature = (jax.tree.structure(args), tuple((np.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(args)),
                 cfg_schedule)
    if signature not in self._compiled:
      self._compiled[signature] = self._lower_parts(args, static).compile()
    return self._compiled[signature](*args)

  def prepare(self, params) -> dict:
    """`params` as this sampler reads them, made once where they are loaded: scanned, the encoder's
    and the decoder's blocks stacked (`scan.stack_blocks`), which it would otherwise do on every
    call (with `host_loop`, in every iteration); unrolled, as they are. Either layout samples the
    same images."""
    if not self.scan_blocks:
      return params
    return {**params, 'mar': stack_blocks(params['mar'], ('encoder_blocks', 'decoder_blocks'))}

  def lower(self, params, key, labels, *, cfg: float = 1.0, cfg_schedule: str = 'linear',
            temperature: float = 1.0, orders=None, noises=None, forced_tokens=None):
    """The lowered program (for compile-time and FLOP accounting): the whole sampler, or with
    `host_loop` its parts (`HostLoop`), whose `compile()` returns what runs the call."""
    args, static = self._checked(params, key, labels, cfg, cfg_schedule, temperature, orders, noises,
                                 forced_tokens)
    return self._lower_parts(args, static) if self.host_loop else self._jitted.lower(*args, **static)

  def arguments(self, params, key, labels, *, cfg: float = 1.0, cfg_schedule: str = 'linear',
                temperature: float = 1.0, orders=None, noises=None, forced_tokens=None) -> tuple:
    """The arguments of the program `lower` returns, for the same call (to run it compiled)."""
    return self._checked(params, key, labels, cfg, cfg_schedule, temperature, orders, noises, forced_tokens)[0]

  def _checked(self, params, key, labels, cfg, cfg_schedule, temperature, orders, noises, forced):
    """Validates the arguments (before anything compiles) -> (traced args, static kwargs)."""
    check_mar_sample_args(self.mar_cfg, labels, cfg, self.guided, cfg_schedule, temperature)
    b, (n, d), num_iter = len(labels), (self.mar_cfg.seq_len, self.mar_cfg.token_embed_dim), self.num_iter
    self.program(b)   # the policy's settings that do not fit this batch fail here, before tracing
    if orders is not None and (np.shape(orders) != (b, n) or
                               (np.sort(np.asarray(orders), axis=1) != np.arange(n)).any()):
      raise ValueError(f'orders must be one permutation of range({n}) per sample [{b}, {n}]')
    if noises is not None:
      check_noises(noises, num_iter, b, self.schedule.mask.max_pred, self.diffusion.num_timesteps, d)
      noises = {k: jnp.asarray(noises[k], jnp.float32) for k in ('init', 'steps')}
    if forced is not None and np.shape(forced) != (num_iter, b, n, d):
      raise ValueError(f'forced_tokens must be [num_iter, B, N, D] = {(num_iter, b, n, d)}, '
                       f'got {np.shape(forced)}')
    args = (params, key, jnp.asarray(labels, jnp.int32), jnp.float32(cfg), jnp.float32(temperature))
    if orders is not None or noises is not None or forced is not None:   # else the program keeps 5 arguments
      args += (dict(orders=None if orders is None else jnp.asarray(orders, jnp.int32), noises=noises,
                    forced=None if forced is None else jnp.asarray(forced, jnp.float32)),)
    return args, dict(cfg_schedule=cfg_schedule)

  def _encoder_lengths(self, most: Optional[int]) -> tuple[Optional[int], ...]:
    """Per iteration, the encoder's static length: its buffer + known positions padded by
    `merge_sizes` into at most `most` lengths, over the iterations whose plan gathers them; None
    (every position, the unknown ones hidden as keys) at the others, or with most None."""
    mc = self.mar_cfg
    if most is not None and (not isinstance(most, int) or most < 1):
      raise ValueError(f'encoder_sizes must be None or an int >= 1, got {most!r}')
    gathered = [most is not None and not p.every_position for p in self.plans]
    kept = [mc.buffer_size + mc.seq_len - int(m) for m in self.schedule.mask.masked]
    padded = merge_sizes(collections.Counter(k for k, g in zip(kept, gathered) if g), most)
    return tuple(padded[k] if g else None for k, g in zip(kept, gathered))

  def _encode(self, mar, stacked, plan: IterPlan, tokens, mask, class_emb, length: Optional[int], state):
    """The encoder's output as the decoder's input [rows, buffer + N, Cd] (rows = tokens' and
    mask's [rows, N, D] / [rows, N]) and the policy's state, through the plan's encoder hooks:
    on `length` gathered positions (the buffer and the known ones first, in order; the rest
    padding, hidden as keys and dropped), or on every position with length None."""
    mp, mc = {'params': mar}, self.mar_cfg
    x = self.model.apply(mp, tokens, class_emb, method=MAR.encoder_input)
    hooks = self.policy.block_hooks(Site(plan, 'encoder'), mc.encoder_depth)
    run = functools.partial(self.model.apply, mp, hooks=hooks, state=state, scan=self.scan_blocks,
                            stacked=stacked.get('encoder'), method=MAR.run_encoder)
    if length is None:
      x, state = run(x, key_mask(mc, mask))
      return self.model.apply(mp, x, mask, method=MAR.decoder_input), state
    keep = keep_indices(mc, mask, length - mc.buffer_size)
    valid = jnp.arange(length) < mc.buffer_size + jnp.sum(~mask, axis=1, keepdims=True)
    x, state = run(jnp.take_along_axis(x, keep[..., None], axis=1), attn_lib.TokenMask(valid[:, None, None, :]))
    positions = jnp.where(valid, keep, mc.buffer_size + mc.seq_len)   # out of range: the scatter drops them
    return self.model.apply(mp, x, None, positions, method=MAR.decoder_input), state

  def _sample(self, params, key, labels, cfg, temperature, draws=None, *, cfg_schedule):
    return self.program(labels.shape[0])._run(params, key, labels, cfg, temperature, draws, cfg_schedule)

  def _run(self, params, key, labels, cfg, temperature, draws, cfg_schedule):
    """The whole call: the iterations as one scan whose body switches to the iteration's trunk,
    then to its head cache's loop."""
    cast, ctx, carry = self._begin(params, key, labels, cfg, temperature, draws, cfg_schedule=cfg_schedule)
    weights, head = self._weights(params, cast)
    mar, stacked = self._views(weights)

    def body(carry, _):
      z, idx, carry, record = _switch(self.trunk_ids, carry['i'], [
          functools.partial(self._trunk, mar, stacked, t, ctx, carry) for t in self.trunks])
      carry, new = _switch(self.head_ids, carry['i'], [
          functools.partial(self._head, h, head, ctx, carry, z, idx) for h in range(len(self.heads))])
      return carry, self._record(idx, new, record)

    carry, records = jax.lax.scan(body, carry, length=self.num_iter)
    images, aux = self._finish(params, carry['tokens'])
    if self.record:
      aux['iterations'] = records
    return images, aux

  def _begin(self, params, key, labels, cfg, temperature, draws=None, *, cfg_schedule):
    """What every iteration reads and what they update, made once per call outside the iterations
    (XLA moves none of it out of the loop) -> (cast, ctx, carry).
    cast: the blocks' and the head's Dense weights in the compute dtype (`_weights` puts them in);
    ctx: 'adaln' each head cache's `head_adaln`, 'order' [B, N] and its 'rank' [B, N], 'class_emb' [B or 2B, Cd], the
    iterations' key and temperature, 'table' the per-iteration counts, guidance scales and draws
    ([num_iter, ...]). carry: 'i' the iteration, 'tokens' [B, N, D], 'state' the policy's."""
    draws = draws or dict(orders=None, noises=None, forced=None)
    mc = self.mar_cfg
    cast = {k: dense_params_in(v, mc.dtype) for k, v in params['mar'].items() if k.startswith(_CAST)}
    mp = {'params': block_views(self._weights(params, cast)[0])}
    b, n, d = labels.shape[0], mc.seq_len, mc.token_embed_dim
    key, k_order = jax.random.split(key)
    order = draws['orders']
    if order is None:
      order = jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(k_order, b)).astype(jnp.int32)
    class_emb = self.model.apply(mp, labels, method=MAR.class_embedding)
    if self.guided:
      class_emb = jnp.concatenate([class_emb, self.model.apply(mp, b, method=MAR.fake_class)])
    s = self.schedule.mask
    mask_len = jnp.asarray(s.mask_len)
    guidance = (jnp.full(mask_len.shape, cfg) if cfg_schedule == 'constant' else 1 + (cfg - 1) * (n - mask_len) / n)
    table = dict(masked=jnp.asarray(s.masked), n_pred=jnp.asarray(s.n_pred), guidance=guidance,
                 noises=draws['noises'], forced=draws['forced'])
    adaln = [head_adaln(self.head, cast['diffloss'], c, self.diffusion.num_timesteps) for c in self.heads]
    ctx = dict(adaln=adaln, key=key, order=order, rank=_ranks(order), class_emb=class_emb,
               temperature=temperature, table=table)
    carry = dict(i=jnp.int32(0), tokens=jnp.zeros((b, n, d), jnp.float32), state=self.policy.init_state(b))
    return cast, ctx, carry

  @staticmethod
  def _weights(params, cast) -> tuple[dict, dict]:
    """(MAR's weights with the `cast` ones in place of their float32 originals, the head's): what
    the trunks and the heads read."""
    return {**params['mar'], **cast}, cast['diffloss']

  def _views(self, weights):
    """(MAR's `weights` as its modules bind them, stacks seen as their blocks; the scanned blocks'
    stacks `MAR.stacked_blocks`, {} unrolled)."""
    mar = block_views(weights)
    return mar, self.model.apply({'params': mar}, method=MAR.stacked_blocks) if self.scan_blocks else {}

  def _trunk(self, mar, stacked, trunk, ctx, carry):
    """Iteration carry['i']'s model part, `trunk` = (plan, encoder lengths; the iteration's among them
    by `length_ids`): encode the known tokens, decode all, the head's conditions at the positions
    idx [B, P] predicted now.
    -> (z [R, Cd] (R = 2BP with guidance: [cond; uncond]), idx, carry with the policy's new state,
    its record)."""
    plan, lengths = trunk
    mp, policy, mc, i, table = {'params': mar}, self.policy, self.mar_cfg, carry['i'], ctx['table']
    tokens, n = carry['tokens'], carry['tokens'].shape[1]
    b = tokens.shape[0]
    idx = self._pred_positions(ctx['order'], table['masked'][i], table['n_pred'][i])
    mask = ctx['rank'] < table['masked'][i]
    state = policy.begin(plan, IterInfo(i, mask, idx), carry['state'])
    rows = 2 * b if self.guided and plan.uncond else b
    t2, m2 = jnp.tile(tokens, (rows // b, 1, 1)), jnp.tile(mask, (rows // b, 1))
    x, state = _switch(self.length_ids, i, [functools.partial(
        self._encode, mar, stacked, plan, t2, m2, ctx['class_emb'][:rows], length, state) for length in lengths])
    x, state = policy.decoder_input(plan, x, state)
    x, state = self.model.apply(mp, x, policy.block_hooks(Site(plan, 'decoder'), mc.decoder_depth), state,
                                scan=self.scan_blocks, stacked=stacked.get('decoder'), method=MAR.run_decoder)
    if self.guided:
      x, state = self._guide(plan, x, state)
    z = self.model.apply(mp, x, method=MAR.decoder_output)
    gather = jnp.minimum(idx, n - 1)
    z = jnp.take_along_axis(z, (jnp.concatenate([gather, gather]) if self.guided else gather)[..., None], axis=1)
    state = policy.end(plan, state)
    record = policy.record(plan, state) if self.record else {}
    return z.reshape(-1, z.shape[-1]), idx, {**carry, 'state': state}, record

  def _head(self, h: int, head, ctx, carry, z, idx):
    """Iteration carry['i']'s tokens at the positions idx [B, P], sampled by the head (its weights
    `head`) through its cache self.heads[h] from the conditions z -> (carry with them in 'tokens'
    and the next 'i', the sampled tokens [B, P, D])."""
    i, table, n, d = carry['i'], ctx['table'], self.mar_cfg.seq_len, self.mar_cfg.token_embed_dim
    noises = jax.tree.map(lambda a: a[i], table['noises'])
    new = self._head_sample(head, self.heads[h], ctx['adaln'][h], jax.random.fold_in(ctx['key'], i),
                            noises, z, table['guidance'][i], ctx['temperature']).reshape(idx.shape + (d,))
    used = new if table['forced'] is None else jnp.take_along_axis(
        table['forced'][i], jnp.minimum(idx, n - 1)[..., None], axis=1)
    # Padding rows carry the out-of-range position N and are dropped.
    tokens = carry['tokens'].at[jnp.arange(idx.shape[0])[:, None], idx].set(used, mode='drop')
    return {**carry, 'i': i + 1, 'tokens': tokens}, new

  def _record(self, idx, new, record: dict) -> Optional[dict]:
    """An iteration's record (with `record`: its predicted positions [B, P], sampled tokens [B, P, D]
    and the policy's decisions), or None."""
    return dict(pred=idx, sampled=new, **record) if self.record else None

  def _finish(self, params, tokens):
    """The sampled tokens [B, N, D] decoded -> (images [B, H, W, 3] in [0, 1], {'tokens': tokens})."""
    latents = self.model.apply({'params': params['mar']}, tokens, method=MAR.unpatchify) / self.vae_scale
    images = self.vae.apply({'params': params['vae']}, latents, method=AutoencoderKL.decode)
    return jnp.clip((images + 1) * 0.5, 0, 1), {'tokens': tokens}

  def _lower_parts(self, args: tuple, static: dict) -> 'HostLoop':
    """The call's parts lowered apart (`HostLoop`): its start, a run program for each distinct body
    (an iteration's trunk and head cache) as a scan over the gcd of the lengths of that body's runs
    of consecutive iterations (each run is then a few calls of it), the decoder; args and static as
    `_checked` gives them. Every run donates its carry and keeps its unused leaves as arguments, so
    each output is written in its input's place: the buffers a run reads stay where they were, and
    XLA replays its recorded CUDA graphs without updating them."""
    prog = self.program(args[2].shape[0])
    cast, ctx, carry = jax.eval_shape(functools.partial(prog._begin, **static), *args)
    weights, head = prog._weights(args[0], cast)
    runs = [(body, len(list(group))) for body, group in itertools.groupby(zip(prog.trunk_ids, prog.head_ids))]
    bodies = list(dict.fromkeys(body for body, _ in runs))
    lengths = tuple(math.gcd(*(n for b, n in runs if b == body)) for body in bodies)
    index = {body: i for i, body in enumerate(bodies)}
    order = tuple(index[b] for b, n in runs for _ in range(n // lengths[index[b]]))

    def run_part(r, weights, head, ctx, carry):
      (t, h), mar_views = bodies[r], prog._views(weights)

      def body(carry, _):
        z, idx, carry, record = prog._trunk(*mar_views, prog.trunks[t], ctx, carry)
        carry, new = prog._head(h, head, ctx, carry, z, idx)
        return carry, prog._record(idx, new, record)
      return jax.lax.scan(body, carry, length=lengths[r])

    part = functools.partial(jax.jit, donate_argnums=3, keep_unused=True)
    return HostLoop(jax.jit(functools.partial(prog._begin, **static)).lower(*args),
                    [part(functools.partial(run_part, r)).lower(weights, head, ctx, carry) for r in range(len(bodies))],
                    jax.jit(prog._finish).lower(args[0], carry['tokens']), prog._weights, order, lengths)

  def _guide(self, plan: IterPlan, x: Array, state):
    """Both CFG halves [2B, buffer + N, Cd] of the decoder blocks' output x ([2B, ...] when the plan
    ran both halves, [B, ...] when it ran the conditional one), as the policy's `guide` gives them."""
    if plan.uncond:
      b = x.shape[0] // 2
      halves = Halves(both=lambda: (x[:b], x[b:]), cond=None)
    else:
      halves = Halves(both=None, cond=lambda: x)
    (cond, uncond), state = self.policy.guide(plan, halves, state)
    return jnp.concatenate([cond, uncond]), state

  def _pred_positions(self, order, masked, n_pred):
    """Positions [B, P] predicted this iteration, ascending as the official nonzero() order;
    the P - n_pred padding rows hold N (out of range) and come last."""
    p, n = self.schedule.mask.max_pred, order.shape[1]
    window = jax.lax.dynamic_slice_in_dim(
        jnp.concatenate([order, jnp.zeros_like(order[:, :p])], axis=1), masked - n_pred, p, axis=1)
    return jnp.sort(jnp.where(jnp.arange(p) < n_pred, window, n), axis=1)

  def _head_sample(self, head, cache, adaln, key, noises, z, guidance, temperature):
    """Diffusion-head sampling of rows z [R, Cd] ([cond; uncond] halves with guidance) through the
    policy's `cache` (or None) -> the conditional rows' tokens [R or R/2, D]; head: its weights;
    adaln: its `head_adaln`; noises: the iteration's draws (see `check_noises`) or None (drawn
    from key)."""
    net = self.head
    if cache is None and noises is None:
      out = diffloss_sample(net, head, z, key, temperature, guidance, guided=self.guided, diffusion=self.diffusion,
                            adaln=adaln[None])
    elif cache is None:
      x_t = noises['init'].reshape(-1, net.in_channels)
      x_t = jnp.concatenate([x_t, x_t]) if self.guided else x_t
      steps = noises['steps'].reshape(self.diffusion.num_timesteps, -1, net.in_channels)
      model_fn = diffloss_model_fn(net, head, z, guidance, self.guided, adaln[None], self.diffusion)
      out = self.diffusion.p_sample_loop_with_noises(model_fn, x_t, steps[:, :x_t.shape[0]], temperature)
    else:
      rows, c = z.shape[0] // 2, net.in_channels
      if noises is None:
        x_t, noise_fn = conditional_draws(key, rows, c)
      else:
        x_t, noise_fn = noises['init'].reshape(rows, c), lambda i: noises['steps'][i, 0].reshape(rows, c)
      return diffloss_sample_cached(net, head, z, x_t, noise_fn, temperature, guidance, cache, self.diffusion, adaln)
    return out[:z.shape[0] // 2] if self.guided else out


def make_mar_sampler(mar_cfg: MARConfig, vae_cfg: AutoencoderKLConfig, *, num_iter: int = 64,
                     guided: bool = True, num_diffusion_steps: Optional[int] = None,
                     policy: Optional[MARPolicy] = None, record: bool = False, scan_blocks: bool = False,
                     encoder_sizes: Optional[int] = 4, host_loop: bool = False):
  """A pure, jit-compiled MAR sampler `sample(params, key, labels, *, cfg, cfg_schedule,
  temperature, orders, noises, forced_tokens) -> (images, aux)`. `guided` (static) doubles the
  batch for CFG; `policy` chooses what each iteration computes (the baseline: everything);
  `record` adds aux['iterations'] (see the module docstring); `scan_blocks`: the encoder's and
  the decoder's runs of alike blocks (no hooks, or a policy's hooks of one `scan_group`) as one
  `lax.scan` each (`MAR.run_encoder`): the program holds a block per run, not per block;
  `encoder_sizes`: the encoder's lengths compiled (the known positions padded into at most this
  many; None: every position at one length, see the module docstring); `host_loop`: the
  iterations driven from the host, each distinct iteration body a program (a scan over
  consecutive alike iterations) of its own, compiled side by side (`HostLoop`), instead of one
  program whose scan switches between them."""
  return _MARSampler(mar_cfg, vae_cfg, num_iter, guided, num_diffusion_steps, policy or BASELINE, record,
                     scan_blocks, encoder_sizes, host_loop)
