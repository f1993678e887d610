"""E-CAR's networks: the multistage AR transformer and one flow denoiser per stage.

Params tree (`init_params`): {'ar': ..., 'denoiser_0': ..., ..., 'denoiser_{S-1}': ...}.

AR transformer (next-stage prediction, ViT backbone). Stage 0's input tokens are
the class embedding at each of its positions; stage s > 0's are a Linear of the
patches of the previous stage's flow end point, nearest-upsampled to stage s's
grid. Every token gets a learned position embedding (one table over all stages)
and its stage's embedding. Attention is block-causal over stages (ScaleCausal
with per-token stage levels: bidirectional inside a stage). A final affine
LayerNorm gives r, the continuous token maps r_s that condition the flows. With
`ar_depth` 0 (the ablation) there are no layers and every stage's input is the
class embedding, so r_s carries the class and position only.

Denoiser of stage s (DiT-style): patch embedding + position embedding of x_t; the
per-token condition c = Linear(r_s) + time embedding; adaLN-zero DiT blocks whose
shift/scale/gate come from c at each token; a per-token adaLN final layer predicts
the velocity patches. Class labels reach the denoisers only through r_s
(label num_classes is the null class of classifier-free guidance).

Choices where the paper is silent:
  - the AR's input at stage s is the *end point* of stage s - 1 (what the sampler
    has in hand when stage s begins); training feeds the exact end point built
    from the same noise as the flow, so training and sampling see one
    distribution (feeding clean latents in training would not match sampling);
  - the AR block is timm's pre-LN ViT block ("ViT backbone"); positions are one
    learned table over all stages' tokens (as VAR's pos_1LC), plus a learned
    stage embedding;
  - the denoiser is DiT's adaLN-zero block with the condition per token, tanh
    GELU, learned positions, DiT's timestep embedding; the AR and the denoisers
    share one patch size, so a denoiser token is an AR token's position;
  - initialisation: xavier-uniform Linears, zero biases, normal(0.02) embeddings,
    zero adaLN modulations and output layers (DiT).
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ecar.config import ECARConfig
from ecar.flow import up2
from ecar.layers import DiTBlock, FinalLayer, patchify, unpatchify
from var_models.nn import attention as attn_lib
from var_models.nn import tokens as tok
from var_models.nn.blocks import BlockHooks, merged_dense, merged_modulations, split_modulations
from var_models.nn.init import compiled_init
from var_models.nn.scan import cache_runs, scan_blocks, scan_runs, stack_of, through_runs
from var_models.nn.timestep import TimestepEmbedder
from var_models.nn.vit import Block, torch_layer_norm, xavier_uniform

Array = jax.Array
_embed_init = nn.initializers.normal(0.02)


def stage_levels(cfg: ECARConfig) -> np.ndarray:
  """[num_tokens] int32: the stage of every AR token."""
  return np.repeat(np.arange(cfg.num_stages, dtype=np.int32), cfg.stage_tokens)


class ARTransformer(nn.Module):
  cfg: ECARConfig

  def setup(self):
    cfg, c = self.cfg, self.cfg.ar_width
    self.class_emb = nn.Embed(cfg.num_classes + 1, c, embedding_init=_embed_init)
    self.pos_embed = self.param('pos_embed', _embed_init, (1, cfg.num_tokens, c))
    self.stage_emb = nn.Embed(cfg.num_stages, c, embedding_init=_embed_init)
    if cfg.ar_depth > 0 and cfg.num_stages > 1:
      self.input_proj = nn.Dense(c, kernel_init=xavier_uniform)
    self.blocks = [Block(c, cfg.ar_heads, cfg.mlp_ratio, backend=cfg.attn_backend, dtype=cfg.dtype)
                   for _ in range(cfg.ar_depth)]
    self.norm = torch_layer_norm(1e-6)
    self.unit_norm = nn.LayerNorm(epsilon=1e-6, use_fast_variance=False, use_scale=False, use_bias=False)

  def class_embedding(self, labels: Array) -> Array:
    """labels [B] (num_classes = the null class) -> [B, C]."""
    return self.class_emb(labels)

  def stage_inputs(self, stage: int, cls: Array, prev_end: Optional[Array]) -> Array:
    """Input tokens [B, N_s, C] of `stage` from the class embedding cls [B, C] (stage 0, or every
    stage without AR layers) or the previous stage's end point prev_end [B, g/2, g/2, D]."""
    cfg = self.cfg
    begin, end = cfg.begin_ends[stage]
    if stage == 0 or cfg.ar_depth == 0:
      x = jnp.broadcast_to(cls[:, None], (cls.shape[0], end - begin, cls.shape[-1]))
    else:
      x = self.input_proj(patchify(up2(prev_end.astype(jnp.float32)), cfg.patch_size))
    return x + self.pos_embed[:, begin:end] + self.stage_emb(jnp.int32(stage))

  def run_blocks(self, x: Array, *, mask: attn_lib.Mask = None,
                 kvs: Union[None, Sequence[attn_lib.KVCache], attn_lib.LayerKVCaches] = None,
                 hooks: Optional[Sequence[Optional[BlockHooks]]] = None, state: Any = None):
    """All blocks on x [B, l, C] -> (h [B, l, C], kvs, state). `kvs`: None (training; one scan
    with `cfg.scan_blocks`), one KVCache per block, or `LayerKVCaches` (sampling, `_run_scanned`)."""
    x = x.astype(self.cfg.dtype)
    if isinstance(kvs, attn_lib.LayerKVCaches):
      return self._run_scanned(x, mask, kvs, hooks, state)
    if kvs is None and hooks is None and self.cfg.scan_blocks and not self.is_initializing():
      def call(block, i, block_hooks, h, s, run):
        h, _, s = block(h, mask=mask, state=s)
        return h, s
      x, state = through_runs(self.blocks, scan_runs([('plain',)] * len(self.blocks)), None, x, state, call,
                              train=True)
      return tok.dense(x), None, state
    new_kvs = []
    for i, block in enumerate(self.blocks):
      x, kv, state = block(x, mask=mask, kv=None if kvs is None else kvs[i],
                           hooks=None if hooks is None else hooks[i], state=state)
      new_kvs.append(kv)
    return tok.dense(x), (None if kvs is None else new_kvs), state

  def _run_scanned(self, x: Array, mask: attn_lib.Mask, kvs: attn_lib.LayerKVCaches, hooks, state):
    """`run_blocks` over stacked caches: each run of consecutive blocks that compute alike with
    caches of one length (`scan.cache_runs`) as one `lax.scan` carrying the whole state
    (`scan.through_runs`; a policy bound with `scanned` indexes its per-block state by the traced
    layer); the other blocks one by one."""
    lengths = list(kvs.lengths)

    def call(block, i, block_hooks, h, carry, run):
      caches, s = carry
      h, kv, s = block(h, mask=mask, kv=caches.layer(i, caches.lengths[i if run is None else run[0]]),
                       hooks=block_hooks, state=s)
      for j in run or [i]:
        lengths[j] = kv.length
      return h, (caches.put(kv), s)
    x, (kvs, state) = through_runs(self.blocks, cache_runs(hooks, kvs.lengths), hooks, x, (kvs, state), call)
    return tok.dense(x), kvs.with_lengths(tuple(lengths)), state

  def output(self, h: Array) -> Array:
    """Final LayerNorm (float32): the token maps r [B, l, C]."""
    return self.norm(h.astype(jnp.float32))

  def __call__(self, labels: Array, prev_ends: Sequence[Array], norm_taps: Optional[dict] = None) -> Array:
    """Teacher-forced: labels [B], prev_ends the end points of stages 0..S-2 -> r [B, num_tokens, C].

    norm_taps {'scale', 'bias'} [S, C], zeros: offsets of the final norm's scale and bias at each stage's
    tokens. r is unchanged (n * 0 + 0 is 0), and a loss's gradient with respect to the taps of stage s
    is the part of its gradient on the final norm that flows through stage s's tokens."""
    cls = self.class_embedding(labels)
    x = jnp.concatenate([self.stage_inputs(s, cls, prev_ends[s - 1] if s else None)
                         for s in range(self.cfg.num_stages)], axis=1)
    levels = stage_levels(self.cfg)
    h, _, _ = self.run_blocks(x, mask=attn_lib.ScaleCausal(levels, levels))
    r = self.output(h)
    if norm_taps is not None:
      unit = self.unit_norm(h.astype(jnp.float32))
      r = r + unit * norm_taps['scale'][levels] + norm_taps['bias'][levels]
    return r


# Rows (a call's tokens) up to which a sampler's unrolled denoiser, its adaLN outputs computed ahead,
# chains its blocks through `pallas_kernels.residual_norm` (`DiTBlock.chained`): one kernel for each
# gated residual and the LayerNorm after it, where XLA runs three of a few microseconds each. Read
# when a sampler is traced.
CHAINED_MAX_ROWS = 128


class Denoiser(nn.Module):
  """The flow denoiser of one stage."""
  cfg: ECARConfig
  stage: int

  def setup(self):
    cfg, w = self.cfg, self.cfg.den_width
    self.x_embed = nn.Dense(w, kernel_init=xavier_uniform, dtype=cfg.dtype)
    self.pos_embed = self.param('pos_embed', _embed_init, (1, cfg.stage_tokens[self.stage], w))
    self.cond_proj = nn.Dense(w, kernel_init=xavier_uniform, dtype=cfg.dtype)
    self.t_embed = TimestepEmbedder(w, cfg.dtype)
    self.blocks = [DiTBlock(w, cfg.den_heads, cfg.mlp_ratio, cfg.attn_backend, cfg.dtype)
                   for _ in range(cfg.den_depths[self.stage])]
    self.final = FinalLayer(w, cfg.token_dim, cfg.dtype)

  def condition(self, r: Array) -> Array:
    """The AR's token map r [B, N_s, C_ar] -> its part of the per-token condition [B, N_s, W]
    (constant over a stage's Euler steps, so the sampler computes it once)."""
    return self.cond_proj(r)

  def velocity(self, x: Array, timestep: Array, cond: Array, adaln: Optional[tuple[Array, Array]] = None,
               ahead: Optional[Array] = None, stacked: Any = None, train: bool = False) -> Array:
    """x [B, g, g, D], timestep [B], cond [B, N_s, W] from `condition` -> velocity [B, g, g, D] float32.
    adaln: `layers.merged_adaln` of this denoiser's params, to run every adaLN Linear as one GEMM;
    ahead: that GEMM's output for this call's (timestep, cond) [B, N_s, sum], computed before the
    flow loop (`adaln_outputs`): timestep and cond are then not read, and on up to
    `CHAINED_MAX_ROWS` rows the unrolled blocks run chained (`_chained`). stacked:
    `stacked_blocks()`, made outside the flow loop, to run the blocks as one `lax.scan` over them
    (`train`: as `scan.scan_blocks` takes it)."""
    cfg = self.cfg
    h = self.x_embed(patchify(x.astype(jnp.float32), cfg.patch_size)) + self.pos_embed
    if ahead is not None and stacked is None and not train and h.shape[0] * h.shape[1] <= CHAINED_MAX_ROWS:
      out = self._chained(h, ahead.reshape(*ahead.shape[:2], -1, cfg.den_width))
      return unpatchify(out.astype(jnp.float32), cfg.patch_size, cfg.stage_sizes[self.stage])
    c = None if ahead is not None else cond + self.t_embed(timestep)[:, None]
    mods = [None] * (len(self.blocks) + 1)
    if ahead is not None:
      mods = split_modulations(ahead, 6 * cfg.den_width, len(self.blocks))
    elif adaln is not None:
      mods = merged_modulations(c, adaln, 6 * cfg.den_width, len(self.blocks), cfg.dtype)
    if stacked is not None:
      xs = None if mods[0] is None else jnp.stack(mods[:-1])
      h, _ = scan_blocks(self.blocks, list(range(len(self.blocks))), h, xs,
                         lambda block, i, h, mod: (block(h, c, mod), None), stacked, train)
    else:
      for block, mod in zip(self.blocks, mods):
        h = block(h, c, mod)
    out = self.final(h, c, mods[-1]).astype(jnp.float32)
    return unpatchify(out, cfg.patch_size, cfg.stage_sizes[self.stage])

  def _chained(self, h: Array, table: Array) -> Array:
    """The blocks and the final layer on h [B, N_s, W] as `DiTBlock.chained` runs them, table [B,
    N_s, 6 depth + 2, W] the adaLN outputs (slots 6i..6i+5 block i's, 6 depth + (0, 1) the final
    layer's shift and scale) -> [B, N_s, patch values]."""
    normed = self.blocks[0].modulated_norm(h, table, 0)
    for i, block in enumerate(self.blocks):
      h, normed = block.chained(h, normed, table, 6 * i, (6 * i + 6, 6 * i + 7))
    return self.final(normed, None, normed=True)

  def stacked_blocks(self) -> Any:
    """The blocks' parameters on a leading layer axis (`scan.stack_of`), for a sampler to take once,
    outside its flow loop (XLA would restack them at every step), and hand to `velocity` (`stacked`)."""
    return stack_of(self.blocks)

  def adaln_outputs(self, timesteps: Array, cond: Array, adaln: tuple[Array, Array]) -> Array:
    """The merged adaLN GEMM of every Euler step at once: timesteps [S], cond [B, N_s, W] ->
    [S, B, N_s, sum], what `velocity` computes at each step's timestep on cond, by the same
    operations on each (step, token). Its weights, a third of the denoiser's, are then read once
    for the S steps instead of once a step."""
    c = cond[None] + self.t_embed(timesteps)[:, None, None]
    return merged_dense(c, adaln, self.cfg.dtype)

  def __call__(self, x: Array, timestep: Array, r: Array) -> Array:
    """The teacher-forced velocity (training); `cfg.scan_blocks`: the blocks as one scan (once
    their parameters exist: `init` creates them one block at a time)."""
    stacked = self.stacked_blocks() if self.cfg.scan_blocks and not self.is_initializing() else None
    return self.velocity(x, timestep, self.condition(r), stacked=stacked, train=True)


class ECAR(nn.Module):
  """The AR transformer and the S denoisers; `__call__` is the teacher-forced training forward."""
  cfg: ECARConfig

  def setup(self):
    self.ar = ARTransformer(self.cfg)
    self.denoiser = [Denoiser(self.cfg, s) for s in range(self.cfg.num_stages)]

  def __call__(self, labels: Array, prev_ends: Sequence[Array], x_t: Sequence[Array],
               timesteps: Sequence[Array], norm_taps: Optional[dict] = None) -> list[Array]:
    """labels [B]; prev_ends: end points of stages 0..S-2; x_t, timesteps: per stage [B, g_s, g_s, D]
    and [B] -> predicted velocities per stage (float32). norm_taps: see `ARTransformer.__call__`."""
    r = self.ar(labels, prev_ends, norm_taps)
    return [self.denoiser[s](x_t[s], timesteps[s], r[:, b:e])
            for s, (b, e) in enumerate(self.cfg.begin_ends)]

  # ---- the pieces the sampler runs stage by stage ----

  def class_embedding(self, labels: Array) -> Array:
    return self.ar.class_embedding(labels)

  def ar_inputs(self, stage: int, cls: Array, prev_end: Optional[Array]) -> Array:
    return self.ar.stage_inputs(stage, cls, prev_end)

  def ar_blocks(self, x: Array, **kwargs):
    return self.ar.run_blocks(x, **kwargs)

  def ar_output(self, h: Array) -> Array:
    return self.ar.output(h)

  def den_condition(self, stage: int, r: Array) -> Array:
    return self.denoiser[stage].condition(r)

  def den_velocity(self, stage: int, x: Array, timestep: Array, cond: Array,
                   adaln: Optional[tuple[Array, Array]] = None, ahead: Optional[Array] = None,
                   stacked: Any = None) -> Array:
    return self.denoiser[stage].velocity(x, timestep, cond, adaln, ahead, stacked)

  def den_stacked_blocks(self, stage: int) -> Any:
    return self.denoiser[stage].stacked_blocks()

  def den_adaln_outputs(self, stage: int, timesteps: Array, cond: Array, adaln: tuple[Array, Array]) -> Array:
    return self.denoiser[stage].adaln_outputs(timesteps, cond, adaln)


def dummy_inputs(cfg: ECARConfig, batch: int = 1):
  """Zero arguments of `ECAR.__call__` with the right shapes: (labels, prev_ends, x_t, timesteps)."""
  d = cfg.data_channels
  grids = [jnp.zeros((batch, g, g, d), jnp.float32) for g in cfg.stage_sizes]
  return (jnp.zeros((batch,), jnp.int32), grids[:-1], grids, [jnp.zeros((batch,), jnp.float32)] * cfg.num_stages)


def init_params(cfg: ECARConfig, key: Array):
  """Random params {'ar', 'denoiser_0', ...} (ViT/DiT initialisation; adaLN and outputs zero).
  Compiled as one program (`init.compiled_init`)."""
  return compiled_init(lambda k: ECAR(cfg).init({'params': k}, *dummy_inputs(cfg))['params'], key)


def param_count(params) -> int:
  return sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))


@functools.lru_cache(maxsize=None)
def abstract_params(cfg: ECARConfig):
  """Parameter shapes (ShapeDtypeStructs) without allocating anything; cached per config."""
  return jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
