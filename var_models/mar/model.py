"""MAR: masked autoregressive image generation with a diffusion loss (Li et al. 2024),
as the official code computes it.

Tokens are patchified, scaled VAE latents [B, N, D]. The MAE encoder sees
`buffer_size` class-embedding tokens followed by the known tokens; the decoder
puts `mask_token` at the masked positions and returns the diffusion condition
z [B, N, Cd] for every position. Dropping masked tokens has two static-shape forms:
  - gathered (`keep_idx` [B, K] given): the encoder runs on exactly the K kept
    positions, in increasing order, as the official boolean indexing does;
    the sampler knows K from its schedule and pads it to one of a few lengths
    (the padding hidden as keys and dropped, `var_models.mar.sampler`);
  - key-masked (`keep_idx` None): the encoder runs on all buffer + N positions and
    masked positions are hidden as attention keys, so the kept tokens' outputs equal
    the dropped form's (every other op is per token); the decoder overwrites the
    masked positions. Training uses it, since its mask count is random.
Training: `MAR(cfg).apply(v, latents, labels, train=True, rngs={'mask': k1, 'dropout': k2})`
-> scalar loss (`loss_fn` wraps this).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from var_models.mar.diffloss import DiffLossConfig, SimpleMLPAdaLN, diffloss_loss, init_diffloss
from var_models.nn import attention as attn_lib
from var_models.nn import tokens as tok
from var_models.nn.init import compiled_init
from var_models.nn.scan import hooks_group, scan_runs, stack_of, through_runs
from var_models.nn.vit import Block, torch_layer_norm, xavier_uniform

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class MARConfig:
  """The official MAR constructor's arguments (its defaults), plus `norm_eps` (the
  official builders' LayerNorm eps), the attention backend and the compute dtype."""
  img_size: int = 256
  vae_stride: int = 16
  patch_size: int = 1
  encoder_embed_dim: int = 1024
  encoder_depth: int = 16
  encoder_num_heads: int = 16
  decoder_embed_dim: int = 1024
  decoder_depth: int = 16
  decoder_num_heads: int = 16
  mlp_ratio: float = 4.0
  norm_eps: float = 1e-6
  vae_embed_dim: int = 16
  mask_ratio_min: float = 0.7
  label_drop_prob: float = 0.1
  class_num: int = 1000
  attn_dropout: float = 0.1
  proj_dropout: float = 0.1
  buffer_size: int = 64
  diffloss_d: int = 3
  diffloss_w: int = 1024
  num_sampling_steps: str = '100'
  diffusion_batch_mul: int = 4
  attn_backend: str = 'xla'
  dtype: Any = jnp.float32

  def __post_init__(self):
    for dim, heads in ((self.encoder_embed_dim, self.encoder_num_heads),
                       (self.decoder_embed_dim, self.decoder_num_heads)):
      if dim % heads:
        raise ValueError(f'MARConfig: width {dim} is not divisible by {heads} heads')
    if self.img_size % (self.vae_stride * self.patch_size):
      raise ValueError(f'MARConfig: img_size {self.img_size} is not a multiple of vae_stride * patch_size')
    if not 0 <= self.mask_ratio_min < 1:
      raise ValueError(f'MARConfig.mask_ratio_min must be in [0, 1), got {self.mask_ratio_min}')
    for name in ('label_drop_prob', 'attn_dropout', 'proj_dropout'):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f'MARConfig.{name} must be in [0, 1), got {getattr(self, name)}')
    attn_lib.check_backend(self.attn_backend)

  @property
  def seq_h(self) -> int:
    return self.img_size // self.vae_stride // self.patch_size

  @property
  def seq_len(self) -> int:
    return self.seq_h ** 2

  @property
  def token_embed_dim(self) -> int:
    return self.vae_embed_dim * self.patch_size ** 2

  def diffloss_config(self) -> DiffLossConfig:
    return DiffLossConfig(target_channels=self.token_embed_dim, z_channels=self.decoder_embed_dim,
                          width=self.diffloss_w, depth=self.diffloss_d,
                          num_sampling_steps=self.num_sampling_steps, dtype=self.dtype)


def _sized(width: int, depth: int, heads: int, diffloss_d: int, diffloss_w: int, kw: dict) -> MARConfig:
  """Encoder and decoder of one size (the official builders), DiffLoss sizes as released."""
  return MARConfig(**{**dict(encoder_embed_dim=width, encoder_depth=depth, encoder_num_heads=heads,
                             decoder_embed_dim=width, decoder_depth=depth, decoder_num_heads=heads,
                             diffloss_d=diffloss_d, diffloss_w=diffloss_w), **kw})


def base(**kw) -> MARConfig:
  """mar_base, DiffLoss 6 x 1024 (208M parameters)."""
  return _sized(768, 12, 12, 6, 1024, kw)


def large(**kw) -> MARConfig:
  """mar_large, DiffLoss 8 x 1280 (479M parameters)."""
  return _sized(1024, 16, 16, 8, 1280, kw)


def huge(**kw) -> MARConfig:
  """mar_huge, DiffLoss 12 x 1536 (943M parameters)."""
  return _sized(1280, 20, 16, 12, 1536, kw)


def tiny(**kw) -> MARConfig:
  """A test-sized model: 32 px / stride 8 -> 4x4 tokens; encoder and decoder widths differ
  so a transposed weight cannot go unnoticed."""
  return MARConfig(**{**dict(img_size=32, vae_stride=8, encoder_embed_dim=32, encoder_depth=2, encoder_num_heads=2,
                             decoder_embed_dim=48, decoder_depth=1, decoder_num_heads=2, vae_embed_dim=4,
                             class_num=10, buffer_size=4, diffloss_d=2, diffloss_w=32,
                             num_sampling_steps='10'), **kw})


def patchify(cfg: MARConfig, latents: Array) -> Array:
  """NHWC latents [B, h*p, w*p, C] -> tokens [B, h*w, C*p*p], features ordered (c, p, q)
  as the official patchify of the NCHW latents."""
  b, hp, wp, c = latents.shape
  p = cfg.patch_size
  x = latents.reshape(b, hp // p, p, wp // p, p, c)
  return x.transpose(0, 1, 3, 5, 2, 4).reshape(b, (hp // p) * (wp // p), c * p * p)


def unpatchify(cfg: MARConfig, tokens: Array) -> Array:
  """Inverse of `patchify`: tokens [B, N, C*p*p] -> NHWC latents [B, h*p, w*p, C]."""
  b, p, h, c = tokens.shape[0], cfg.patch_size, cfg.seq_h, cfg.vae_embed_dim
  x = tokens.reshape(b, h, h, c, p, p)
  return x.transpose(0, 1, 4, 2, 5, 3).reshape(b, h * p, h * p, c)


def diffloss_net(cfg: MARConfig) -> SimpleMLPAdaLN:
  """The DiffLoss denoiser, unbound (parent=None) so that MAR's methods can build it for the
  functional DiffLoss API; `DiffLossConfig.make_net` would bind it to the calling module."""
  d = cfg.diffloss_config()
  return SimpleMLPAdaLN(model_channels=d.width, z_channels=d.z_channels, num_res_blocks=d.depth,
                        in_channels=d.target_channels, out_channels=2 * d.target_channels, dtype=d.dtype,
                        parent=None)


def _with_buffer(cfg: MARConfig, mask: Array) -> Array:
  """mask [B, N] (True = masked) -> [B, buffer + N]; buffer positions are never masked."""
  return jnp.concatenate([jnp.zeros((mask.shape[0], cfg.buffer_size), bool), mask.astype(bool)], axis=1)


def key_mask(cfg: MARConfig, mask: Array) -> attn_lib.TokenMask:
  """The encoder's attention mask for mask [B, N] (True = masked): buffer and known tokens
  are keys, masked ones are not (MAE's dropping, at a static shape)."""
  return attn_lib.TokenMask(~_with_buffer(cfg, mask)[:, None, None, :])


def keep_indices(cfg: MARConfig, mask: Array, n_known: int) -> Array:
  """The kept positions [B, buffer + n_known] (int32, increasing) of buffer + sequence,
  for mask [B, N] with exactly n_known (static) unmasked tokens per row."""
  order = jnp.argsort(_with_buffer(cfg, mask), axis=1, stable=True)   # kept (False) first, in order
  return order[:, :cfg.buffer_size + n_known].astype(jnp.int32)


def random_mask(cfg: MARConfig, key: Array, batch: int) -> Array:
  """The official training mask [B, N] bool (True = masked): one ratio per batch from
  N(1, 0.25) truncated to [mask_ratio_min, 1], ceil(N * ratio) tokens masked per sample
  at uniformly random positions (the first ones of a random order)."""
  k_ratio, k_order = jax.random.split(key)
  n = cfg.seq_len
  ratio = 1.0 + 0.25 * jax.random.truncated_normal(k_ratio, (cfg.mask_ratio_min - 1.0) / 0.25, 0.0)
  num_masked = jnp.ceil(n * ratio)
  # A uniform permutation's value at a position is that position's rank in a uniform order.
  rank = jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(k_order, batch))
  return rank < num_masked


@functools.lru_cache(maxsize=None)
def _diffloss_init(cfg: DiffLossConfig):
  """`init_diffloss` of `cfg` as one jitted function per config: flax's `param` traces its initializer
  on every apply to check the parameter's shape, and a jitted one is traced once."""
  return jax.jit(functools.partial(init_diffloss, cfg))


class MAR(nn.Module):
  """Parameter names follow the official ones; blocks are `encoder_blocks_{i}` and
  `decoder_blocks_{i}`, and `diffloss` holds the `SimpleMLPAdaLN` tree."""
  cfg: MARConfig

  def setup(self):
    cfg = self.cfg
    ce, cd, length = cfg.encoder_embed_dim, cfg.decoder_embed_dim, cfg.buffer_size + cfg.seq_len
    std02 = nn.initializers.normal(0.02)
    dense = lambda features: nn.Dense(features, kernel_init=xavier_uniform)
    self.class_emb = nn.Embed(cfg.class_num, ce, embedding_init=std02)
    self.fake_latent = self.param('fake_latent', std02, (1, ce))
    self.z_proj = dense(ce)
    self.z_proj_ln = torch_layer_norm(1e-6)   # fixed, not norm_eps: the official hard-codes it
    self.encoder_pos_embed_learned = self.param('encoder_pos_embed_learned', std02, (1, length, ce))
    self.encoder_blocks = self._blocks(ce, cfg.encoder_depth, cfg.encoder_num_heads)
    self.encoder_norm = torch_layer_norm(cfg.norm_eps)
    self.decoder_embed = dense(cd)
    self.mask_token = self.param('mask_token', std02, (1, 1, cd))
    self.decoder_pos_embed_learned = self.param('decoder_pos_embed_learned', std02, (1, length, cd))
    self.decoder_blocks = self._blocks(cd, cfg.decoder_depth, cfg.decoder_num_heads)
    self.decoder_norm = torch_layer_norm(cfg.norm_eps)
    self.diffusion_pos_embed_learned = self.param('diffusion_pos_embed_learned', std02, (1, cfg.seq_len, cd))
    # One pytree-valued param, so the head's tree is exactly `init_diffloss`'s and the
    # functional DiffLoss API (and the sampler) take it as is.
    self.diffloss = self.param('diffloss', _diffloss_init(cfg.diffloss_config()))

  def _blocks(self, width: int, depth: int, heads: int) -> list[Block]:
    cfg = self.cfg
    return [Block(width, heads, cfg.mlp_ratio, qkv_bias=True, norm_eps=cfg.norm_eps, attn_drop=cfg.attn_dropout,
                  proj_drop=cfg.proj_dropout, backend=cfg.attn_backend, dtype=cfg.dtype)
            for _ in range(depth)]

  def class_embedding(self, labels: Array) -> Array:
    """labels [B] in [0, class_num) -> [B, Ce]."""
    return self.class_emb(labels)

  def fake_class(self, batch: int) -> Array:
    """The null-class embedding (CFG's unconditional branch) for `batch` rows: [batch, Ce]."""
    return jnp.broadcast_to(self.fake_latent, (batch, self.cfg.encoder_embed_dim))

  def patchify(self, latents: Array) -> Array:
    return patchify(self.cfg, latents)

  def unpatchify(self, tokens: Array) -> Array:
    return unpatchify(self.cfg, tokens)

  def stacked_blocks(self) -> dict:
    """{'encoder', 'decoder'}: each stack's block parameters on a leading layer axis (`scan.stack_of`),
    for a sampler to take once, outside its loop, and hand to `run_encoder`/`run_decoder` (`stacked`)."""
    return {name: stack_of(blocks)
            for name, blocks in (('encoder', self.encoder_blocks), ('decoder', self.decoder_blocks))}

  def _run(self, blocks, x: Array, mask: attn_lib.Mask, train: bool, hooks, state, scan: bool, stacked):
    """The blocks in turn on x [B, l, C] -> (x, state); with `scan` (sampling), each run of consecutive
    blocks that compute alike (no hooks, or hooks of one `scan_group`) as one `lax.scan`
    (`scan.through_runs`, over `stacked` when given) carrying the whole state."""
    if scan and train:
      raise ValueError('MAR runs its blocks as a scan only when sampling (train=False)')
    groups = [hooks_group(None if hooks is None else hooks[i]) if scan else None for i in range(len(blocks))]

    def call(block, i, block_hooks, h, s, run):
      h, _, s = block(h, mask=mask, hooks=block_hooks, state=s, deterministic=not train)
      return h, s
    x, state = through_runs(blocks, scan_runs(groups), hooks, x.astype(self.cfg.dtype), state, call, stacked)
    return tok.dense(x), state

  # ---- the pieces of the encoder and decoder (samplers call them with policy hooks) ----

  def encoder_input(self, tokens: Array, class_emb: Array, train: bool = False) -> Array:
    """tokens [B, N, D], class_emb [B, Ce] -> the encoder's input [B, buffer + N, Ce]. In
    training the class embedding becomes `fake_latent` with probability label_drop_prob per
    sample (rng 'dropout'), as the official does inside its encoder."""
    cfg = self.cfg
    b = tokens.shape[0]
    if train and cfg.label_drop_prob > 0:
      drop = jax.random.uniform(self.make_rng('dropout'), (b,)) < cfg.label_drop_prob
      class_emb = jnp.where(drop[:, None], self.fake_latent, class_emb)
    buffer = jnp.broadcast_to(class_emb[:, None], (b, cfg.buffer_size, cfg.encoder_embed_dim))
    x = jnp.concatenate([buffer, self.z_proj(tokens)], axis=1) + self.encoder_pos_embed_learned
    return self.z_proj_ln(x)

  def run_encoder(self, x: Array, mask: attn_lib.Mask = None, hooks=None, state: Any = None,
                  train: bool = False, scan: bool = False, stacked: Any = None):
    """The encoder blocks and norm on x [B, l, Ce] -> (x, state); `hooks` (one `BlockHooks`
    or None per block) come from a sampling policy and carry its `state`; `scan` as `_run`,
    over `stacked` (`stacked_blocks()['encoder']`) when given."""
    x, state = self._run(self.encoder_blocks, x, mask, train, hooks, state, scan, stacked)
    return self.encoder_norm(x), state

  def decoder_input(self, x: Array, mask: Optional[Array], keep_idx: Optional[Array] = None) -> Array:
    """Encoder output -> the decoder's input [B, buffer + N, Cd]: mask_token at the masked
    positions (those outside keep_idx when it is given, else where mask [B, N] is True)."""
    cfg = self.cfg
    x = self.decoder_embed(x)
    b, length = x.shape[0], cfg.buffer_size + cfg.seq_len
    filler = jnp.broadcast_to(self.mask_token, (b, length, cfg.decoder_embed_dim)).astype(x.dtype)
    if keep_idx is None:
      x = jnp.where(_with_buffer(cfg, mask)[..., None], filler, x)
    else:
      x = tok.scatter(filler, keep_idx, x)
    return x + self.decoder_pos_embed_learned

  def run_decoder(self, x: Array, hooks=None, state: Any = None, train: bool = False, scan: bool = False,
                  stacked: Any = None):
    """The decoder blocks on x [B, buffer + N, Cd] -> (x, state), the rest as `run_encoder`."""
    return self._run(self.decoder_blocks, x, None, train, hooks, state, scan, stacked)

  def decoder_output(self, x: Array) -> Array:
    """Decoder blocks' output -> the diffusion condition z [B, N, Cd] (float32)."""
    x = self.decoder_norm(x).astype(jnp.float32)
    return x[:, self.cfg.buffer_size:] + self.diffusion_pos_embed_learned

  def encode(self, tokens: Array, mask: Optional[Array], class_emb: Array, keep_idx: Optional[Array] = None,
             train: bool = False) -> Array:
    """MAE encoder. tokens [B, N, D], mask [B, N] bool (True = masked), class_emb [B, Ce].

    Returns [B, K, Ce] for the kept positions keep_idx [B, K] (see `keep_indices`; mask is
    then unused), or without keep_idx [B, buffer + N, Ce] whose masked positions hold no
    meaning.
    """
    x = self.encoder_input(tokens, class_emb, train)
    if keep_idx is None:
      attn_mask = key_mask(self.cfg, mask)
    else:
      x, attn_mask = tok.gather(x, keep_idx), None
    return self.run_encoder(x, attn_mask, train=train)[0]

  def decode(self, x: Array, mask: Optional[Array], keep_idx: Optional[Array] = None, train: bool = False) -> Array:
    """MAE decoder on `encode`'s output -> diffusion condition z [B, N, Cd] (float32)."""
    x = self.run_decoder(self.decoder_input(x, mask, keep_idx), train=train)[0]
    return self.decoder_output(x)

  def __call__(self, latents: Array, labels: Array, train: bool = True) -> Array:
    """Training loss (scalar) of scaled VAE latents [B, h, w, C] (NHWC) and labels [B].

    rng 'mask' draws what defines the loss (the mask, diffusion steps and noise), so an
    eval loss needs only it; rng 'dropout' (train only) drives dropout and label drop.
    The loss is DiffLoss on the masked tokens, with every row repeated
    diffusion_batch_mul times, each repeat with its own step and noise.
    """
    cfg = self.cfg
    tokens = self.patchify(latents)
    b, n = tokens.shape[:2]
    k_mask, k_diff = jax.random.split(self.make_rng('mask'))
    mask = random_mask(cfg, k_mask, b)
    z = self.decode(self.encode(tokens, mask, self.class_embedding(labels), train=train), mask, train=train)
    rows = lambda a: a.reshape(b * n, -1)
    return diffloss_loss(diffloss_net(cfg), self.diffloss, rows(tokens), rows(z), mask.reshape(b * n), k_diff,
                         repeats=cfg.diffusion_batch_mul, diffusion=cfg.diffloss_config().train_diffusion())


def loss_fn(model: MAR, params, latents: Array, labels: Array, key: Array, *, train: bool = True) -> Array:
  """Scalar training loss with the 'mask' and 'dropout' streams split from one key."""
  k_mask, k_drop = jax.random.split(key)
  return model.apply({'params': params}, latents, labels, train=train, rngs={'mask': k_mask, 'dropout': k_drop})


def init_params(cfg: MARConfig, key: Array):
  """Random parameters with the official initialisation (DiffLoss's own included), compiled as
  one program (`init.compiled_init`)."""
  tokens = jnp.zeros((1, cfg.seq_len, cfg.token_embed_dim), jnp.float32)
  mask = jnp.zeros((1, cfg.seq_len), bool)

  # Encode + decode touch every parameter (setup's own, each submodule by its call), so
  # init need not trace the loss: a much smaller program to compile.
  def forward(model: MAR):
    return model.decode(model.encode(tokens, mask, model.class_embedding(jnp.zeros((1,), jnp.int32))), mask)
  return compiled_init(lambda k: MAR(cfg).init(k, method=forward)['params'], key)
