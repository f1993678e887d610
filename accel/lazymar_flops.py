"""LazyMAR's model FLOPs per image: what `accel.lazymar` computes, counted as MAR's own.

    counts = lazymar_sampling_flops(mar.huge(), KL16, LazyMAR.preset('official'))

The convention of `var_models.mar.flops.sampling_flops` (2 FLOPs per multiply-add of every matmul,
attention's included; element-wise work such as norms, the similarity scores and the caches' gathers
and scatters left out; the VAE decoder apart, 'decode'), on the shapes the computation needs rather
than the compiled sampler's static ones (its encoder's and head's rows and its kept counts padded),
as the baseline's count is made. The bound policy's schedule gives, per iteration:
  - full iterations (refreshes, and every iteration when no iteration cache is on): MAR's
    computation, both CFG halves, the encoder on the buffer + known tokens, the decoder on all
    L = buffer + N positions;
  - cached iterations, on the rows that run (the conditional half with the condition cache, else
    both): z_proj on every token (as the baseline); with the encoder cache each encoder block on
    the buffer + the previous iteration's predictions as queries, over buffer + known keys, and
    decoder_embed on those positions only (the decoder's other inputs are cached), else MAR's
    encoder; with the decoder cache blocks before `similarity_block` s and block s's attention on
    all L positions, block s's MLP and the later blocks on the n kept ones, n queries over L keys;
  - the head, at every iteration: our DiffLoss loop with the policy's head cache
    (`diffloss_sample_cached`), traced whole on the iteration's predicted tokens.
Each piece is a jaxpr of the model's own modules (`var_models.flop_count.flops`) on ShapeDtypeStructs:
the encoder and decoder blocks through hooks that forward the required counts of queries and MLP
tokens and pad their keys to the required length.

Where the official code (feihongyan1/LazyMAR) computes more than we count:
  - the head's cached steps: its running res blocks compute their whole adaLN Linear (shift, scale,
    gate) and use the gate only; ours computes the gate's third alone;
  - cached iterations: z_proj on both CFG halves, and decoder_embed on both halves' buffer + known
    positions (it embeds the whole encoder output, then keeps only the refreshed positions).
`official_extra` counts both (MAR-H, official preset: 1.55 T over our 22.05 T, nearly all the head's).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from accel.lazymar import LazyMAR
from var_models.flop_count import flops
from var_models.mar.diffloss import diffloss_sample, diffloss_sample_cached, head_adaln
from var_models.mar.flops import KEY, decode_flops, polynomial, sds
from var_models.mar.gaussian_diffusion import create_diffusion
from var_models.mar.model import MAR, MARConfig, diffloss_net, init_params
from var_models.mar.policy import IterPlan
from var_models.mar.schedule import MARSchedule, MaskSchedule, mask_schedule
from var_models.nn.blocks import BlockHooks
from var_models.nn.policy import Binding
from var_models.tokenizers.autoencoder_kl import AutoencoderKLConfig


def lazymar_sampling_flops(cfg: MARConfig, vae_cfg: AutoencoderKLConfig, policy: LazyMAR, *, num_iter: int = 64,
                           num_steps: int = 100) -> dict:
  """{'per_image', 'per_image_without_decode', 'transformer', 'head', 'decode'}: FLOPs of sampling one
  image with `policy` (guided, `num_iter` iterations, `num_steps` head steps), as `sampling_flops`."""
  policy, sched = _bound(cfg, policy, num_iter, num_steps)
  trans = float(sum(_iteration(cfg, policy, sched, step) for step in range(num_iter)))
  head = _head(cfg, policy, num_steps)
  heads = float(sum(head(int(n)) for n in sched.n_pred))
  decode = decode_flops(cfg, vae_cfg)
  return {'per_image': trans + heads + decode, 'per_image_without_decode': trans + heads,
          'transformer': trans, 'head': heads, 'decode': decode}


def official_extra(cfg: MARConfig, policy: LazyMAR, *, num_iter: int = 64, num_steps: int = 100) -> float:
  """FLOPs per image the official code's way of computing `policy`'s caches adds to
  `lazymar_sampling_flops` (module docstring), by the Dense shapes: the adaLN's shift and scale
  columns at the head's cached steps, z_proj and decoder_embed on the rows and positions we skip."""
  (policy, sched), extra = _bound(cfg, policy, num_iter, num_steps), 0.0
  if policy.head:
    cached_steps = policy.head_cache(IterPlan()).kinds(num_steps).count('cached')
    running = cfg.diffloss_d - len(policy.head_skip)
    extra += cfg.seq_len * cached_steps * running * 2 * cfg.diffloss_w * 2 * cfg.diffloss_w
  for step in range(num_iter):
    cached, rows, known, fresh, _ = _sizes(cfg, policy, sched, step)
    if cached:
      extra += 2 * (2 - rows) * cfg.seq_len * cfg.token_embed_dim * cfg.encoder_embed_dim
      extra += 2 * (2 * known - rows * fresh) * cfg.encoder_embed_dim * cfg.decoder_embed_dim
  return extra


def _bound(cfg: MARConfig, policy: LazyMAR, num_iter: int, num_steps: int) -> tuple[LazyMAR, MaskSchedule]:
  """(the policy bound as a guided sampler of `num_iter` iterations and `num_steps` head steps binds it,
  that sampler's mask schedule)."""
  schedule = MARSchedule(mask_schedule(cfg.seq_len, num_iter), num_steps)
  return policy.bind(Binding(cfg, schedule, guided=True)), schedule.mask


def _sizes(cfg: MARConfig, policy: LazyMAR, sched: MaskSchedule, step: int) -> tuple[bool, int, int, int, int]:
  """(cached, rows, known, fresh, kept) of iteration `step`: whether it is a cached one, the CFG rows that
  run, the buffer + known tokens (the encoder's keys), the encoder's queries, and the decoder positions
  forwarded past the similarity block."""
  b = policy.bound
  cached = policy.caches_iterations and not b.refresh[step]
  known = b.buffer + cfg.seq_len - int(sched.masked[step])
  return (cached, 1 if cached and policy.condition else 2, known,
          b.buffer + int(sched.n_pred[step - 1]) if cached and policy.encoder else known,
          b.keep[step] if cached and policy.decoder else b.length)


def _iteration(cfg: MARConfig, policy: LazyMAR, sched: MaskSchedule, step: int) -> float:
  """Encoder and decoder FLOPs of iteration `step` (module docstring)."""
  _, rows, known, fresh, kept = _sizes(cfg, policy, sched, step)
  length, s, depth = policy.bound.length, policy.similarity_block, cfg.decoder_depth
  encoder = (_encoder_input(cfg) + cfg.encoder_depth * _block(cfg, 'encoder', fresh, fresh, known)
             + _decoder_embed(cfg, fresh))
  full = _block(cfg, 'decoder', length, length, length)
  decoder = depth * full if kept == length else (s * full + _block(cfg, 'decoder', length, kept, length)
                                                 + (depth - s - 1) * _block(cfg, 'decoder', kept, kept, length))
  return rows * (encoder + decoder)


class _Sized(BlockHooks):
  """A block whose attention forwards `attn` tokens over `keys` keys and whose MLP forwards `ffn`
  tokens (the first ones of its input; the keys are its own, zero-padded: counts depend on shapes)."""

  def __init__(self, attn: int, ffn: int, keys: int):
    self.attn, self.ffn, self.keys = attn, ffn, keys

  def select(self, site, x, state):
    count = self.attn if site == 'attn' else self.ffn
    if count == x.shape[1]:
      return None, state
    return jnp.broadcast_to(jnp.arange(count, dtype=jnp.int32), (x.shape[0], count)), state

  def kv(self, k, v, idx, state):
    pad = ((0, 0), (0, self.keys - k.shape[1]), (0, 0), (0, 0))
    return jnp.pad(k, pad), jnp.pad(v, pad), state


@functools.lru_cache(maxsize=None)
def _model(cfg: MARConfig):
  """(MAR(cfg) bound to shape-only params, the params): its submodules trace alone, skipping MAR's
  setup (whose DiffLoss param re-traces the head's init) at every count."""
  params = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
  return MAR(cfg).bind({'params': params}), params


def _alone(cfg: MARConfig, name: str, submodule, method, *shapes: tuple[int, ...]) -> float:
  """FLOPs of `method`(module, *inputs) of MAR(cfg)'s `submodule`(model), whose params are `name`, on
  float32 inputs of `shapes`."""
  bound, params = _model(cfg)
  module = submodule(bound).clone(parent=None)
  return flops(lambda p, *x: module.apply({'params': p}, *x, method=method), params[name],
               *(sds(*shape) for shape in shapes))


# One CFG row each: every piece's count is linear in its rows.
@functools.lru_cache(maxsize=None)
def _block(cfg: MARConfig, part: str, attn: int, ffn: int, keys: int) -> float:
  """An encoder or decoder block (`part`) with `_Sized(attn, ffn, keys)`'s counts."""
  hooks = _Sized(attn, ffn, keys)
  return _alone(cfg, f'{part}_blocks_0', lambda m: getattr(m, f'{part}_blocks')[0],
                lambda m, x: m(x, hooks=hooks)[0], (1, max(attn, ffn), getattr(cfg, f'{part}_embed_dim')))


@functools.lru_cache(maxsize=None)
def _encoder_input(cfg: MARConfig) -> float:
  """The encoder's input (z_proj of every token)."""
  return flops(lambda p, t, c: MAR(cfg).apply({'params': p}, t, c, method=MAR.encoder_input), _model(cfg)[1],
               sds(1, cfg.seq_len, cfg.token_embed_dim), sds(1, cfg.encoder_embed_dim))


@functools.lru_cache(maxsize=None)
def _decoder_embed(cfg: MARConfig, tokens: int) -> float:
  """decoder_embed on `tokens` encoder outputs."""
  return _alone(cfg, 'decoder_embed', lambda m: m.decoder_embed, lambda m, x: m(x),
                (1, tokens, cfg.encoder_embed_dim))


def _head(cfg: MARConfig, policy: LazyMAR, num_steps: int):
  """n -> FLOPs of one iteration's DiffLoss loop on n predicted tokens (linear in n: fitted on two)."""
  net, diffusion, params = diffloss_net(cfg), create_diffusion(str(num_steps)), _model(cfg)[1]['diffloss']
  cache = policy.head_cache(IterPlan())   # the same at every iteration

  # The adaLN weights, merged once per call by the sampler, come in merged (not counted).
  adaln = jax.eval_shape(lambda p: head_adaln(net, p, cache, num_steps), params)

  def count(n: int) -> float:
    z = sds(2 * n, cfg.decoder_embed_dim)
    if cache is None:
      return flops(lambda p, a, z, k: diffloss_sample(net, p, z, k, 1.0, 2.0, guided=True, diffusion=diffusion,
                                                      adaln=a[None]), params, adaln, z, KEY)
    return flops(lambda p, a, z, x: diffloss_sample_cached(net, p, z, x, lambda i: jnp.zeros_like(x), 1.0, 2.0,
                                                           cache, diffusion, a),
                 params, adaln, z, sds(n, cfg.token_embed_dim))
  return polynomial(count, (1, 2))
