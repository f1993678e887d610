"""VAR's class-conditional sampler (the official `autoregressive_infer_cfg`), compiled whole.

    sample = make_sampler(var_cfg, vq_cfg)                # optionally: policy=...
    images, aux = sample(params, key, labels, cfg=1.5, top_k=900, top_p=0.96)

`params = {'var': ..., 'vqvae': ...}`; images [B, H, W, 3] in [0, 1]; aux holds
the per-scale token maps ('indices', -1 where a policy forwarded nothing) and,
if asked, the per-scale f_hat and CFG-combined logits. The batch is doubled for
CFG (conditional, then the unconditional label), each attention layer keeps a
KV cache, and guidance at scale k is t = cfg * k / (K - 1): logits = (1 + t) *
cond - t * uncond (the halves from the policy's `guide`), sampled by top-k, then
top-p, then a categorical draw.
Arguments are checked before anything compiles.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from var_models.nn import tokens as tok
from var_models.nn.attention import KVCache, LayerKVCaches
from var_models.nn.blocks import CUBLAS_GEMMS
from var_models.nn.checks import check_labels
from var_models.nn.resample import area_resize
from var_models.nn.scan import block_views, stack_blocks
from var_models.nn.policy import Halves
from var_models.tokenizers.vqvae import VQVAE, VQVAEConfig
from var_models.var.model import VAR, VARConfig
from var_models.var.policy import BASELINE, ScalePolicy, Site, Step, check_plan, var_binding

Array = jax.Array


def sample_top_k_top_p(key: Array, logits: Array, top_k: int, top_p: float) -> Array:
  """Draws token ids [...] from logits [..., V] restricted to the top k, then the top-p nucleus.

  The official rule: keep the k largest logits; of those, drop the ascending-sorted
  ones whose cumulative probability is <= 1 - p, always keeping the largest; draw
  from the softmax of what is left. top_k 0 and top_p 1 disable a filter. Only the
  sorted candidates are touched: one uniform per token picks from their CDF, so no
  [..., V] permutation, scatter or Gumbel noise is materialised.
  """
  v = logits.shape[-1]
  k = top_k if 0 < top_k < v else v
  if k < v:
    vals, ids = jax.lax.top_k(logits, k)
  else:
    ids = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), logits.shape)
    neg, ids = jax.lax.sort((-logits, ids), dimension=logits.ndim - 1, num_keys=1)
    vals = -neg
  probs = jax.nn.softmax(vals, axis=-1)
  if top_p < 1.0:
    # Descending order: candidate j goes iff the mass of j and all smaller ones is <= 1 - p.
    tail = jnp.flip(jnp.cumsum(jnp.flip(probs, -1), -1), -1)
    keep = (tail > 1 - top_p).at[..., 0].set(True)
    probs = jax.nn.softmax(jnp.where(keep, vals, -jnp.inf), axis=-1)
  cdf = jnp.cumsum(probs, axis=-1)
  u = jax.random.uniform(key, logits.shape[:-1] + (1,), jnp.float32) * cdf[..., -1:]
  j = jnp.minimum(jnp.sum(cdf <= u, axis=-1), k - 1)
  return jnp.take_along_axis(ids, j[..., None], axis=-1)[..., 0].astype(jnp.int32)


def check_sample_args(var_cfg: VARConfig, labels, cfg: float, top_k: int, top_p: float) -> None:
  check_labels(labels, var_cfg.num_classes)
  if not np.isfinite(cfg) or cfg < 0:
    raise ValueError(f'cfg must be >= 0, got {cfg}')
  if not 0 <= top_k <= var_cfg.vocab_size:
    raise ValueError(f'top_k must be in [0, {var_cfg.vocab_size}], got {top_k}')
  if not 0 < top_p <= 1:
    raise ValueError(f'top_p must be in (0, 1], got {top_p}')


def check_configs(var_cfg: VARConfig, vq_cfg: VQVAEConfig) -> None:
  if tuple(var_cfg.patch_nums) != tuple(vq_cfg.patch_nums):
    raise ValueError(f'VAR patch_nums {var_cfg.patch_nums} != VQVAE patch_nums {vq_cfg.patch_nums}')
  if (var_cfg.vocab_size, var_cfg.cvae) != (vq_cfg.vocab_size, vq_cfg.z_channels):
    raise ValueError(f'VAR vocab/Cvae ({var_cfg.vocab_size}, {var_cfg.cvae}) != VQVAE '
                     f'({vq_cfg.vocab_size}, {vq_cfg.z_channels})')


def _step_inputs(model: VAR, vp, step: Step, cond2: Array, f_hat: Array) -> Array:
  """Input tokens of the step's scales [2B, l, C]: scale 0 from the class, scale k from
  f_hat area-downsampled to its size (the official next_token_map)."""
  sched = model.cfg.schedule
  parts = []
  for si in step.scales:
    if si == 0:
      parts.append(model.apply(vp, cond2, method=VAR.first_tokens))
      continue
    pn = sched.patch_nums[si]
    x = area_resize(f_hat, (pn, pn)).reshape(f_hat.shape[0], pn * pn, -1)
    begin, end = sched.begin_ends[si]
    parts.append(jnp.tile(model.apply(vp, x, begin, end, method=VAR.embed_tokens), (2, 1, 1)))
  return jnp.concatenate(parts, axis=1)


class _Sampler:
  """Holds the static parts (models, schedule, policy); `__call__` is the public sampler."""

  def __init__(self, var_cfg: VARConfig, vq_cfg: VQVAEConfig, policy: ScalePolicy,
               return_fhats: bool, return_logits: bool, scan_blocks: bool):
    check_configs(var_cfg, vq_cfg)
    self.var_cfg = var_cfg
    self.model, self.vq = VAR(var_cfg), VQVAE(vq_cfg)
    self.sched = var_cfg.schedule
    self.policy = policy.bind(var_binding(var_cfg, scan_blocks))
    self.steps = self.policy.plan(self.sched)
    check_plan(self.steps, self.sched)
    self.return_fhats, self.return_logits = return_fhats, return_logits
    self.scan_blocks = scan_blocks
    self._jitted = jax.jit(self._sample, static_argnames=('top_k', 'top_p'),
                           compiler_options=CUBLAS_GEMMS if scan_blocks else None)

  def __call__(self, params, key: Array, labels, *, cfg: float = 1.5, top_k: int = 0,
               top_p: float = 1.0):
    args, static = self._checked(params, key, labels, cfg, top_k, top_p)
    return self._jitted(*args, **static)

  def prepare(self, params) -> dict:
    """`params` as this sampler reads them, made once where they are loaded: scanned, the blocks'
    parameters stacked (`scan.stack_blocks`), which it would otherwise do on every call;
    unrolled, as they are. Either layout samples the same images."""
    return {**params, 'var': stack_blocks(params['var'], ('blocks',))} if self.scan_blocks else params

  def lower(self, params, key, labels, *, cfg=1.5, top_k=0, top_p=1.0):
    """The lowered program (for compile-time and FLOP accounting)."""
    args, static = self._checked(params, key, labels, cfg, top_k, top_p)
    return self._jitted.lower(*args, **static)

  def arguments(self, params, key, labels, *, cfg=1.5, top_k=0, top_p=1.0) -> tuple:
    """The arguments of the program `lower` returns, for the same call (to run it compiled)."""
    return self._checked(params, key, labels, cfg, top_k, top_p)[0]

  def _checked(self, params, key, labels, cfg, top_k, top_p):
    """Validates the arguments (before anything compiles) -> (traced args, static kwargs)."""
    check_sample_args(self.var_cfg, labels, cfg, top_k, top_p)
    return (params, key, jnp.asarray(labels, jnp.int32), jnp.float32(cfg)), dict(top_k=int(top_k), top_p=float(top_p))

  def _sample(self, params, key, labels, cfg, *, top_k: int, top_p: float):
    vc, sched, policy = self.var_cfg, self.sched, self.policy
    vp, qp = {'params': block_views(params['var'])}, {'params': params['vqvae']}
    b = labels.shape[0]
    cond2 = self.model.apply(vp, jnp.concatenate([labels, jnp.full_like(labels, vc.num_classes)]),
                             method=VAR.cond_embed)
    mods = self.model.apply(vp, cond2, method=VAR.modulations)
    cache = LayerKVCaches.create if self.scan_blocks else KVCache.create_many
    kvs = cache(vc.depth, 2 * b, sched.L, vc.num_heads, vc.head_dim, vc.dtype)
    f_hat = jnp.zeros((b, sched.final_hw, sched.final_hw, vc.cvae), jnp.float32)
    state = policy.init_state(b)
    cached_levels = np.zeros((0,), np.int32)  # scale of each cached key, while no token is pruned
    aux = {'indices': [], 'f_hats': [], 'logits': []}
    for index, step in enumerate(self.steps):
      site = Site(index, step)
      x = _step_inputs(self.model, vp, step, cond2, f_hat)
      sel, state = policy.select_input(site, x, state)
      hooks = policy.block_hooks(site, vc.depth)
      mask, cached_levels = self._step_mask(step, cached_levels, sel, hooks)
      h, kvs, state = self.model.apply(
          vp, x if sel is None else tok.gather(x, sel), mods, mask=mask, kvs=kvs, hooks=hooks,
          state=state, method=VAR.run_blocks)
      logits = self.model.apply(vp, h, cond2, method=VAR.logits)
      key, f_hat, state = self._sample_step(key, step, logits, sel, cfg, f_hat, state, qp, aux, top_k, top_p)
      state = policy.after_step(site, f_hat, state)
    images = (self.vq.apply(qp, f_hat, method=VQVAE.fhat_to_img) + 1) * 0.5
    aux = {k: v for k, v in aux.items() if v}
    return images, aux

  def _step_mask(self, step: Step, cached_levels, sel, hooks):
    """(the policy's layout for the step, the cached keys' levels after it).

    Levels stay static while every block forwards the same tokens and the policy says how
    many of each scale it forwards (`input_counts`); a step of several scales needs them for
    its scale-causal mask, so it cannot follow or do pruning that leaves them unknown.
    """
    counts = self.policy.input_counts(step)
    if sel is not None and counts is not None and sel.shape[1] != sum(counts):
      raise ValueError(f'step {step}: select_input forwards {sel.shape[1]} tokens, input_counts says {counts}')
    known = cached_levels is not None and hooks is None and (sel is None or counts is not None)
    if len(step.scales) > 1 and not known:
      raise ValueError(f'step {step} decodes several scales: no pruning of unknown counts may precede or join it')
    if counts is None:
      counts = tuple(self.sched.lengths[si] for si in step.scales)
    q_levels = np.repeat(np.asarray(step.scales, np.int32), counts)
    mask = None
    if len(step.scales) > 1:
      mask = self.policy.attn_mask(step, q_levels, np.concatenate([cached_levels, q_levels]))
    return mask, (np.concatenate([cached_levels, q_levels]) if known else None)

  def _sample_step(self, key, step, logits, sel, cfg, f_hat, state, qp, aux, top_k, top_p):
    """Guides, samples and adds the codes of every scale of the step to f_hat [B, H, W, C], from
    the step's logits [2B, l', V] (l' the forwarded tokens `sel` [2B, l'], or all) -> (key, f_hat,
    state): the policy's `guide` gives each scale's halves [B, l_si, V]."""
    sched, b = self.sched, f_hat.shape[0]
    k_last = sched.num_scales - 1
    logits_full = logits if sel is None else tok.scatter(
        jnp.zeros((logits.shape[0], sum(sched.lengths[si] for si in step.scales), logits.shape[-1]),
                  logits.dtype), sel, logits)
    offset = 0
    for si in step.scales:
      n = sched.lengths[si]
      both = logits_full[:, offset:offset + n]
      (c, u), state = self.policy.guide(si, Halves(both=lambda: (both[:b], both[b:]), cond=None), state)
      t = cfg * si / k_last
      lg = (1 + t) * c - t * u
      key, sub = jax.random.split(key)
      idx = sample_top_k_top_p(sub, lg, top_k, top_p)
      codes = self.vq.apply(qp, idx, method=VQVAE.embed)
      if sel is not None:
        kept = _kept_mask(sel[:b], offset, n)
        idx = jnp.where(kept, idx, -1)
        codes = jnp.where(kept[..., None], codes, 0.0)
      pn = sched.patch_nums[si]
      f_hat, _ = self.vq.apply(qp, si, f_hat, codes.reshape(b, pn, pn, -1), method=VQVAE.next_ar_input)
      aux['indices'].append(idx)
      if self.return_fhats:
        aux['f_hats'].append(f_hat)
      if self.return_logits:
        aux['logits'].append(lg)
      offset += n
    return key, f_hat, state


def _kept_mask(sel: Array, offset: int, n: int) -> Array:
  """[B, n] bool: which tokens of the scale at [offset, offset + n) of the step were forwarded."""
  local = sel - offset
  hit = (local[..., None] == jnp.arange(n)) & (local[..., None] >= 0)
  return hit.any(axis=1)


def make_sampler(var_cfg: VARConfig, vq_cfg: VQVAEConfig, policy: Optional[ScalePolicy] = None, *,
                 return_fhats: bool = False, return_logits: bool = False, scan_blocks: bool = False):
  """A pure, jit-compiled sampler `sample(params, key, labels, *, cfg, top_k, top_p) -> (images, aux)`.

  `scan_blocks`: the KV caches stacked on a layer axis, and each scale's runs of alike blocks (no
  hooks, or a policy's hooks of one `scan_group`) as one `lax.scan` (`VAR.run_blocks`): the program
  holds a block per run, not per block, and compiles that much faster; the images are the unrolled
  sampler's. It compiles with cuBLAS GEMMs (`blocks.CUBLAS_GEMMS`). benchmarks/RESULTS.md has its cost at run time.
  """
  return _Sampler(var_cfg, vq_cfg, policy or BASELINE, return_fhats, return_logits, scan_blocks)
