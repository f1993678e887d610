"""VAR: next-scale prediction transformer (Tian et al. 2024), as the official code computes it.

Teacher-forced training: `VAR.apply(v, labels, x_tf)` -> logits [B, L, V] with the
scale-causal mask. Sampling uses the step methods (`cond_embed`, `first_tokens`,
`embed_tokens`, `run_blocks`, `logits`) from `var_models.var.sampler`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from var_models.nn import attention as attn_lib
from var_models.nn import tokens as tok
from var_models.nn.blocks import AdaLNBeforeHead, AdaLNSelfAttn, BlockHooks, scaled, trunc_normal
from var_models.nn.init import compiled_init
from var_models.nn.scan import cache_runs, scan_blocks
from var_models.var.schedules import ScaleSchedule, VAR_256

Array = jax.Array

# The official training script's gamma init per depth (init_adaln_gamma).
_ADALN_GAMMA = {16: 1e-3, 20: 1e-3, 24: 1e-4, 30: 1e-5}


@dataclasses.dataclass(frozen=True)
class VARConfig:
  depth: int = 16
  width: Optional[int] = None          # default 64 * depth
  num_heads: Optional[int] = None      # default depth
  mlp_ratio: float = 4.0
  num_classes: int = 1000
  vocab_size: int = 4096
  cvae: int = 32
  patch_nums: tuple[int, ...] = VAR_256.patch_nums
  shared_aln: bool = False
  attn_l2_norm: bool = True
  norm_eps: float = 1e-6
  drop_rate: float = 0.0
  drop_path_rate: Optional[float] = None  # default 0.1 * depth / 24
  cond_drop_rate: float = 0.1
  init_adaln: float = 0.5
  init_adaln_gamma: Optional[float] = None  # default per depth, else 1e-5
  init_head: float = 0.02
  attn_backend: str = 'xla'
  dtype: Any = jnp.float32

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    if self.width is None:
      set_('width', 64 * self.depth)
    if self.num_heads is None:
      set_('num_heads', self.depth)
    if self.drop_path_rate is None:
      set_('drop_path_rate', 0.1 * self.depth / 24)
    if self.init_adaln_gamma is None:
      set_('init_adaln_gamma', _ADALN_GAMMA.get(self.depth, 1e-5))
    set_('patch_nums', tuple(self.patch_nums))
    self.validate()

  def validate(self) -> None:
    if self.depth <= 0:
      raise ValueError(f'VARConfig.depth must be positive, got {self.depth}')
    if self.width % self.num_heads:
      raise ValueError(f'VARConfig.width {self.width} is not divisible by num_heads {self.num_heads}')
    if not 0 <= self.cond_drop_rate < 1:
      raise ValueError(f'VARConfig.cond_drop_rate must be in [0, 1), got {self.cond_drop_rate}')
    attn_lib.check_backend(self.attn_backend)

  @property
  def schedule(self) -> ScaleSchedule:
    return ScaleSchedule(self.patch_nums)

  @property
  def head_dim(self) -> int:
    return self.width // self.num_heads


class VAR(nn.Module):
  cfg: VARConfig

  def setup(self):
    cfg, c = self.cfg, self.cfg.width
    sched = cfg.schedule
    std = math.sqrt(1 / (3 * c))
    dense_init = trunc_normal(std)
    proj_init = scaled(dense_init, 1 / math.sqrt(2 * cfg.depth))
    self.word_embed = nn.Dense(c, kernel_init=dense_init)
    self.class_emb = nn.Embed(cfg.num_classes + 1, c, embedding_init=dense_init)
    self.pos_start = self.param('pos_start', dense_init, (1, sched.first_l, c))
    self.pos_1LC = self.param('pos_1LC', dense_init, (1, sched.L, c))
    self.lvl_embed = nn.Embed(sched.num_scales, c, embedding_init=dense_init)
    if cfg.shared_aln:
      self.shared_ada_lin = nn.Dense(6 * c, kernel_init=dense_init, dtype=cfg.dtype)
    dpr = np.linspace(0, cfg.drop_path_rate, cfg.depth)
    self.blocks = [
        AdaLNSelfAttn(c, cfg.num_heads, cfg.mlp_ratio, cfg.norm_eps, cfg.attn_l2_norm, cfg.shared_aln,
                      float(dpr[i]), dense_init, proj_init, self._block_ada_init(std), cfg.drop_rate,
                      cfg.attn_backend, cfg.dtype, name=f'blocks_{i}')
        for i in range(cfg.depth)
    ]
    self.head_nm = AdaLNBeforeHead(c, cfg.norm_eps, scaled(dense_init, cfg.init_adaln))
    # The head's GEMM (C x V per token) runs in the compute dtype, as under the official
    # fp16 autocast; its AdaLN and the logits stay float32.
    self.head = nn.Dense(cfg.vocab_size, kernel_init=scaled(dense_init, cfg.init_head), dtype=cfg.dtype)

  def _block_ada_init(self, std: float):
    """Gamma rows x init_adaln_gamma, scale/shift rows x init_adaln (official init_weights)."""
    cfg, c = self.cfg, self.cfg.width
    if cfg.shared_aln:
      base, axis = nn.initializers.normal(1 / math.sqrt(c)), 0      # ada_gss [6, C]
      factors = np.repeat([cfg.init_adaln_gamma, cfg.init_adaln], [2, 4])
    else:
      base, axis = trunc_normal(std), 1                            # kernel [D, 6C]
      factors = np.repeat([cfg.init_adaln_gamma, cfg.init_adaln], [2 * c, 4 * c])

    def init(key, shape, dtype=jnp.float32):
      f = jnp.asarray(factors, dtype)
      return base(key, shape, dtype) * (f[:, None] if axis == 0 else f[None, :])
    return init

  # ---- pieces shared by training and sampling ----

  def cond_embed(self, labels: Array) -> Array:
    """labels [B] (num_classes = unconditional) -> class embedding [B, C] (float32)."""
    return self.class_emb(labels)

  def block_cond(self, cond: Array) -> Array:
    """What each block's AdaLN consumes: cond [B, C], or the shared [B, 6, C]."""
    if self.cfg.shared_aln:
      return self.shared_ada_lin(nn.silu(cond)).reshape(cond.shape[0], 6, self.cfg.width)
    return cond

  def lvl_pos(self, begin: int, end: int) -> Array:
    """Level + position embedding of tokens [begin, end): [1, end - begin, C]."""
    levels = jnp.asarray(self.cfg.schedule.level_ids()[begin:end])
    return self.lvl_embed(levels)[None] + self.pos_1LC[:, begin:end]

  def first_tokens(self, cond: Array) -> Array:
    """Input of the first scale: class embedding + pos_start + level/pos. [B, first_l, C]."""
    first_l = self.cfg.schedule.first_l
    return cond[:, None] + self.pos_start + self.lvl_pos(0, first_l)

  def embed_tokens(self, x_cvae: Array, begin: int, end: int) -> Array:
    """Input of tokens [begin, end) from their VQVAE features x [B, end - begin, Cvae]."""
    return self.word_embed(x_cvae.astype(jnp.float32)) + self.lvl_pos(begin, end)

  def modulations(self, cond: Array) -> list[Array]:
    """Every block's AdaLN modulation [B, 6, C] from the class embedding cond [B, C]."""
    bc = self.block_cond(cond)
    return [block.modulation(bc) for block in self.blocks]

  def run_blocks(self, x: Array, mods: Sequence[Array], *, mask: attn_lib.Mask = None,
                 kvs: Union[None, Sequence[attn_lib.KVCache], attn_lib.LayerKVCaches] = None,
                 hooks: Optional[Sequence[Optional[BlockHooks]]] = None, state: Any = None,
                 deterministic: bool = True):
    """All blocks on x [B, l, C] with their modulations -> (h [B, l, C], kvs, state).

    `kvs`: None (training), one KVCache per block, or `LayerKVCaches`: then every run of two or
    more consecutive blocks that compute alike (`scan.cache_runs`) is one `lax.scan` (`scan_blocks`),
    which compiles the block once; the other blocks run one by one.
    """
    x = x.astype(self.cfg.dtype)
    if isinstance(kvs, attn_lib.LayerKVCaches):
      return self._run_layer_caches(x, mods, mask, kvs, hooks, state)
    new_kvs = []
    for i, block in enumerate(self.blocks):
      x, kv, state = block(x, mods[i], mask=mask, kv=None if kvs is None else kvs[i],
                           hooks=None if hooks is None else hooks[i], state=state,
                           deterministic=deterministic)
      new_kvs.append(kv)
    return tok.dense(x), (None if kvs is None else new_kvs), state

  def _run_layer_caches(self, x: Array, mods: Sequence[Array], mask: attn_lib.Mask,
                        kvs: attn_lib.LayerKVCaches, hooks, state):
    """`run_blocks` over stacked caches (sampling: deterministic), a scan per run (`scan.cache_runs`)."""
    lengths = list(kvs.lengths)
    for run in cache_runs(hooks, kvs.lengths):
      run_hooks = [None if hooks is None else hooks[i] for i in run]
      if len(run) == 1:
        i = run[0]
        x, kv, state = self.blocks[i](x, mods[i], mask=mask, kv=kvs.layer(i), hooks=run_hooks[0], state=state)
        kvs, lengths[i] = kvs.put(kv), kv.length
        continue
      x, kvs, state, length = self._scan_run(run, run_hooks, tok.dense(x), mods, mask, kvs, state)
      for i in run:
        lengths[i] = length
    return tok.dense(x), kvs.with_lengths(tuple(lengths)), state

  def _scan_run(self, run: list[int], run_hooks: list, x: Array, mods: Sequence[Array], mask: attn_lib.Mask,
                kvs: attn_lib.LayerKVCaches, state):
    """The blocks of `run` (alike, their caches of one length) as one scan -> (x, kvs, state, the
    caches' new length). The first block's hooks stand for all; each block's `layer_state`
    entries go in and come out stacked under the first block's names."""
    template, length, new_length = run_hooks[0], kvs.lengths[run[0]], []
    names = [() if h is None else h.layer_state() for h in run_hooks]
    mine = {k for n in names for k in n}
    given = {t: jnp.stack([state[n[j]] for n in names]) for j, t in enumerate(names[0])
             if all(n[j] in state for n in names)}
    shared = state if template is None else {k: v for k, v in state.items() if k not in mine}

    def call(block, i, carry, layer):
      x, caches, shared = carry
      mod, own = layer
      hooks = None if template is None else template.for_layer(i)
      x, kv, out = block(x, mod, mask=mask, kv=caches.layer(i, length), hooks=hooks,
                         state=shared if template is None else {**shared, **own})
      new_length.append(kv.length)
      if template is not None:
        shared = {k: v for k, v in out.items() if k not in names[0]}
        own = {t: out[t] for t in names[0] if t in out}
      return (tok.dense(x), caches.put(kv), shared), own
    (x, kvs, state), own = scan_blocks(self.blocks, run, (x, kvs, shared),
                                       (jnp.stack([mods[i] for i in run]), given), call)
    for j, t in enumerate(names[0]):
      if t in own:
        state = {**state, **{n[j]: own[t][r] for r, n in enumerate(names)}}
    return x, kvs, state, new_length[0]

  def logits(self, h: Array, cond: Array) -> Array:
    """AdaLN before head (float32), then the head. [B, l, C] -> float32 logits [B, l, V]."""
    return self.head(self.head_nm(h.astype(jnp.float32), cond)).astype(jnp.float32)

  # ---- teacher forcing ----

  def __call__(self, labels: Array, x_tf: Array, *, train: bool = False) -> Array:
    """labels [B], x_tf [B, L - first_l, Cvae] (VQVAE teacher-forcing input) -> logits [B, L, V].

    In training, labels are replaced by the unconditional class with probability
    cond_drop_rate (rng stream 'dropout'), and dropout / drop-path are active.
    """
    cfg, sched = self.cfg, self.cfg.schedule
    if train and cfg.cond_drop_rate > 0:
      drop = jax.random.uniform(self.make_rng('dropout'), labels.shape) < cfg.cond_drop_rate
      labels = jnp.where(drop, cfg.num_classes, labels)
    cond = self.cond_embed(labels)
    x = jnp.concatenate([self.first_tokens(cond), self.embed_tokens(x_tf, sched.first_l, sched.L)], 1)
    levels = sched.level_ids()
    h, _, _ = self.run_blocks(x, self.modulations(cond), mask=attn_lib.ScaleCausal(levels, levels),
                              deterministic=not train)
    return self.logits(h, cond)


def cross_entropy(logits: Array, targets: Array) -> Array:
  """Mean token cross-entropy. logits [B, L, V] float32, targets [B, L] int."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def loss_fn(model: VAR, params, labels: Array, x_tf: Array, targets: Array, *,
            train: bool = False, rng: Optional[Array] = None) -> tuple[Array, Array]:
  """Teacher-forced loss: (mean cross-entropy, logits [B, L, V])."""
  rngs = {'dropout': rng} if train else {}
  logits = model.apply({'params': params}, labels, x_tf, train=train, rngs=rngs)
  return cross_entropy(logits, targets), logits


def param_count(params) -> int:
  return sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))


def init_params(cfg: VARConfig, key: Array):
  """Random parameters with the official initialisation (`init.compiled_init`)."""
  sched = cfg.schedule
  labels = jnp.zeros((1,), jnp.int32)
  x_tf = jnp.zeros((1, sched.L - sched.first_l, cfg.cvae), jnp.float32)
  return compiled_init(lambda k: VAR(cfg).init({'params': k}, labels, x_tf)['params'], key)
