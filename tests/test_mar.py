"""MAR: official parameter counts, the converter against a float64 NumPy re-implementation
of the official MAE encoder/decoder (token dropping included) in both of our dropping
forms, masking, label dropout, patchify, init and training."""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from state_dict_edits import edited

from var_models.convert.mar import convert_mar
from var_models.mar import model as mar
from var_models.mar.model import MAR, keep_indices, random_mask
from var_models.nn.vit import Block
from var_models.var.model import param_count

# Counted on the official torch models (models/mar.py mar_base/large/huge, DiffLoss
# depth x width 6 x 1024, 8 x 1280, 12 x 1536), DiffLoss included.
OFFICIAL_PARAMS = {'base': 207_924_768, 'large': 478_326_304, 'huge': 942_403_104}
FREQ = 256   # DiffLoss timestep-feature width


def official_shapes(cfg: mar.MARConfig) -> dict:
  """Every key of the official MAR state dict with its torch shape."""
  ce, cd, d, n = cfg.encoder_embed_dim, cfg.decoder_embed_dim, cfg.token_embed_dim, cfg.seq_len
  length = cfg.buffer_size + n
  lin = lambda pre, i, o: {pre + '.weight': (o, i), pre + '.bias': (o,)}
  norm = lambda pre, c: {pre + '.weight': (c,), pre + '.bias': (c,)}
  s = {'class_emb.weight': (cfg.class_num, ce), 'fake_latent': (1, ce), 'mask_token': (1, 1, cd),
       'encoder_pos_embed_learned': (1, length, ce), 'decoder_pos_embed_learned': (1, length, cd),
       'diffusion_pos_embed_learned': (1, n, cd),
       **lin('z_proj', d, ce), **norm('z_proj_ln', ce), **norm('encoder_norm', ce),
       **lin('decoder_embed', ce, cd), **norm('decoder_norm', cd)}
  for name, c, depth in (('encoder_blocks', ce, cfg.encoder_depth), ('decoder_blocks', cd, cfg.decoder_depth)):
    hid = int(c * cfg.mlp_ratio)
    for i in range(depth):
      b = f'{name}.{i}.'
      s.update({**norm(b + 'norm1', c), **lin(b + 'attn.qkv', c, 3 * c), **lin(b + 'attn.proj', c, c),
                **norm(b + 'norm2', c), **lin(b + 'mlp.fc1', c, hid), **lin(b + 'mlp.fc2', hid, c)})
  w, p = cfg.diffloss_w, 'diffloss.net.'
  s.update({**lin(p + 'input_proj', d, w), **lin(p + 'cond_embed', cd, w), **lin(p + 'time_embed.mlp.0', FREQ, w),
            **lin(p + 'time_embed.mlp.2', w, w), **lin(p + 'final_layer.adaLN_modulation.1', w, 2 * w),
            **lin(p + 'final_layer.linear', w, 2 * d)})
  for i in range(cfg.diffloss_d):
    b = f'{p}res_blocks.{i}.'
    s.update({**norm(b + 'in_ln', w), **lin(b + 'mlp.0', w, w), **lin(b + 'mlp.2', w, w),
              **lin(b + 'adaLN_modulation.1', w, 3 * w)})
  return s


def official_state_dict(cfg: mar.MARConfig, seed: int = 0) -> dict:
  """Random weights under the official names and layouts; fan-in scaled weights, O(1)
  tables and norm gains near 1, so every term of the forward matters."""
  rng = np.random.default_rng(seed)
  sd = {}
  for k, shape in official_shapes(cfg).items():
    if len(shape) == 2 and k.endswith('.weight') and 'emb.' not in k:
      v = rng.standard_normal(shape) / math.sqrt(shape[1])
    elif len(shape) == 1 and k.endswith('.weight'):
      v = 1 + 0.1 * rng.standard_normal(shape)
    else:
      v = 0.5 * rng.standard_normal(shape)
    sd[k] = v.astype(np.float32)
  return sd


def ref_encode_decode(sd: dict, cfg: mar.MARConfig, tokens, mask, class_emb) -> np.ndarray:
  """Official forward_mae_encoder + forward_mae_decoder (eval) in float64 NumPy:
  masked tokens are dropped by boolean indexing. -> z [B, N, Cd]."""
  g = lambda k: np.asarray(sd[k], np.float64)
  lin = lambda x, pre: x @ g(pre + '.weight').T + g(pre + '.bias')
  erf = np.vectorize(math.erf)

  def ln(x, pre, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * g(pre + '.weight') + g(pre + '.bias')

  def block(x, pre, heads):
    bsz, n, c = x.shape
    qkv = lin(ln(x, pre + '.norm1', cfg.norm_eps), pre + '.attn.qkv')
    q, k, v = qkv.reshape(bsz, n, 3, heads, c // heads).transpose(2, 0, 3, 1, 4)
    a = q @ k.swapaxes(-1, -2) / math.sqrt(c // heads)
    a = np.exp(a - a.max(-1, keepdims=True))
    out = ((a / a.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(bsz, n, c)
    x = x + lin(out, pre + '.attn.proj')
    h = lin(ln(x, pre + '.norm2', cfg.norm_eps), pre + '.mlp.fc1')
    return x + lin(0.5 * h * (1 + erf(h / math.sqrt(2))), pre + '.mlp.fc2')

  bsz, buf = len(tokens), cfg.buffer_size
  keep = ~np.concatenate([np.zeros((bsz, buf), bool), mask], 1)
  x = lin(np.asarray(tokens, np.float64), 'z_proj')
  x = np.concatenate([np.repeat(np.asarray(class_emb, np.float64)[:, None], buf, 1), x], 1)
  x = ln(x + g('encoder_pos_embed_learned'), 'z_proj_ln', 1e-6)
  x = x[keep].reshape(bsz, -1, x.shape[-1])
  for i in range(cfg.encoder_depth):
    x = block(x, f'encoder_blocks.{i}', cfg.encoder_num_heads)
  x = lin(ln(x, 'encoder_norm', cfg.norm_eps), 'decoder_embed')
  full = np.broadcast_to(g('mask_token'), keep.shape + (x.shape[-1],)).copy()
  full[keep] = x.reshape(-1, x.shape[-1])
  x = full + g('decoder_pos_embed_learned')
  for i in range(cfg.decoder_depth):
    x = block(x, f'decoder_blocks.{i}', cfg.decoder_num_heads)
  return ln(x, 'decoder_norm', cfg.norm_eps)[:, buf:] + g('diffusion_pos_embed_learned')


def fixed_mask(cfg: mar.MARConfig, batch: int, n_masked: int, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  mask = np.zeros((batch, cfg.seq_len), bool)
  for row in mask:
    row[rng.permutation(cfg.seq_len)[:n_masked]] = True
  return mask


@functools.partial(jax.jit, static_argnames=('cfg', 'train'))
def _encode_decode(params, tokens, mask, labels, uncond, keep_idx, key, cfg, train):
  """(encoder output, z); rows with `uncond` use the fake class."""
  model, v = MAR(cfg), {'params': params}
  ce = jnp.where(uncond[:, None], model.apply(v, labels.shape[0], method=MAR.fake_class),
                 model.apply(v, labels, method=MAR.class_embedding))
  rngs = {'dropout': key}
  x = model.apply(v, tokens, mask, ce, keep_idx, train, method=MAR.encode, rngs=rngs)
  return x, model.apply(v, x, mask, keep_idx, train, method=MAR.decode, rngs=rngs)


def encode_decode(cfg, params, tokens, mask, labels, uncond, *, gathered: bool, train: bool = False, seed: int = 0):
  keep_idx = keep_indices(cfg, jnp.asarray(mask), cfg.seq_len - int(mask[0].sum())) if gathered else None
  x, z = _encode_decode(params, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(labels), jnp.asarray(uncond),
                        keep_idx, jax.random.key(seed), cfg, train)
  return np.asarray(x), np.asarray(z)


def inputs(cfg: mar.MARConfig, batch: int = 3, seed: int = 1):
  rng = np.random.default_rng(seed)
  tokens = rng.standard_normal((batch, cfg.seq_len, cfg.token_embed_dim)).astype(np.float32)
  labels = rng.integers(0, cfg.class_num, batch)
  uncond = np.arange(batch) == batch - 1   # the last row is CFG's unconditional one
  return tokens, labels, uncond


def rel_err(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def shapes_of(tree):
  return jax.tree_util.tree_map(lambda a: tuple(a.shape), tree)


init = jax.jit(mar.init_params, static_argnums=0)
EVAL = dict(attn_dropout=0.0, proj_dropout=0.0)   # dropout off where a test compares outputs


# ---- parameter counts and initialisation ----

@pytest.mark.parametrize('size', sorted(OFFICIAL_PARAMS))
def test_param_count_matches_official(size):
  cfg = getattr(mar, size)()
  shapes = jax.eval_shape(lambda k: mar.init_params(cfg, k), jax.random.key(0))
  assert param_count(shapes) == OFFICIAL_PARAMS[size]


def test_init_follows_official_initialize_weights():
  cfg = mar.tiny(encoder_embed_dim=64, class_num=200)
  p = jax.device_get(init(cfg, jax.random.key(0)))
  for name in ('fake_latent', 'mask_token', 'encoder_pos_embed_learned', 'decoder_pos_embed_learned',
               'diffusion_pos_embed_learned'):
    assert abs(np.std(p[name]) / 0.02 - 1) < 0.25, name
  assert abs(np.std(p['class_emb']['embedding']) / 0.02 - 1) < 0.1
  blk = p['encoder_blocks_0']
  for kernel in (blk['attn']['qkv']['kernel'], blk['mlp']['fc2']['kernel'], p['z_proj']['kernel']):
    bound = math.sqrt(6 / sum(kernel.shape))   # xavier_uniform
    assert np.max(np.abs(kernel)) <= bound and abs(np.std(kernel) / (bound / math.sqrt(3)) - 1) < 0.1
  for leaf in (blk['attn']['qkv']['bias'], blk['mlp']['fc1']['bias'], p['decoder_embed']['bias'],
               blk['norm1']['bias'], p['z_proj_ln']['bias']):
    assert not np.any(leaf)
  np.testing.assert_array_equal(blk['norm2']['scale'], 1.0)
  np.testing.assert_array_equal(p['decoder_norm']['scale'], 1.0)


def test_apply_traces_the_heads_initializer_once_per_config(monkeypatch):
  # flax checks each existing parameter's shape on every apply by tracing its initializer; the
  # head's is a whole DiffLoss init, so later applies reuse the first one's trace.
  traced, real = [], mar.init_diffloss
  monkeypatch.setattr(mar, 'init_diffloss', lambda c, k: traced.append(c) or real(c, k))
  mar._diffloss_init.cache_clear()
  try:
    cfg = mar.tiny()
    params = jax.eval_shape(lambda k: mar.init_params(cfg, k), jax.random.key(0))
    counts = []
    for batch in (1, 2, 3):
      out = jax.eval_shape(lambda p, b=batch: MAR(cfg).apply({'params': p}, b, method=MAR.fake_class), params)
      assert out.shape == (batch, cfg.encoder_embed_dim)
      counts.append(len(traced))
    assert counts == [counts[0]] * 3 and set(traced) == {cfg.diffloss_config()}
  finally:
    mar._diffloss_init.cache_clear()


# ---- converter and the two dropping forms ----

def test_converted_encode_decode_match_numpy_reference_in_both_dropping_forms():
  cfg = mar.tiny(**EVAL)
  sd = official_state_dict(cfg)
  params = convert_mar(sd, cfg)
  assert shapes_of(params) == shapes_of(jax.eval_shape(lambda k: mar.init_params(cfg, k), jax.random.key(0)))
  tokens, labels, uncond = inputs(cfg)
  mask = fixed_mask(cfg, len(labels), n_masked=11)
  class_emb = np.where(uncond[:, None], sd['fake_latent'], sd['class_emb.weight'][labels])
  want = ref_encode_decode(sd, cfg, tokens, mask, class_emb)
  x_gather, z_gather = encode_decode(cfg, params, tokens, mask, labels, uncond, gathered=True)
  x_keys, z_keys = encode_decode(cfg, params, tokens, mask, labels, uncond, gathered=False)
  assert z_gather.shape == z_keys.shape == want.shape == (3, cfg.seq_len, cfg.decoder_embed_dim)
  assert x_gather.shape == (3, cfg.buffer_size + cfg.seq_len - 11, cfg.encoder_embed_dim)
  assert rel_err(z_gather, want) < 1e-5 and rel_err(z_keys, want) < 1e-5
  kept = ~np.concatenate([np.zeros((3, cfg.buffer_size), bool), mask], 1)
  np.testing.assert_allclose(x_keys[kept].reshape(x_gather.shape), x_gather, rtol=1e-5, atol=1e-5)


def test_keep_indices_is_the_boolean_drop_order():
  cfg = mar.tiny()
  mask = fixed_mask(cfg, 4, n_masked=6, seed=3)
  got = np.asarray(keep_indices(cfg, jnp.asarray(mask), cfg.seq_len - 6))
  with_buffer = np.concatenate([np.zeros((4, cfg.buffer_size), bool), mask], 1)
  np.testing.assert_array_equal(got, np.stack([np.flatnonzero(~row) for row in with_buffer]))


def test_convert_accepts_ddp_prefix():
  cfg = mar.tiny()
  sd = official_state_dict(cfg)
  got = convert_mar({'module.' + k: v for k, v in sd.items()}, cfg)
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, convert_mar(sd, cfg))


@pytest.mark.parametrize('key, make', [
    ('encoder_blocks.1.attn.qkv.bias', None),                                            # missing
    ('diffloss.net.res_blocks.1.mlp.0.weight', None),                                    # missing head key
    ('encoder_blocks.2.norm1.weight', lambda cfg: np.ones(32, np.float32)),              # deeper encoder
    ('decoder_blocks.0.attn.q_norm.weight', lambda cfg: np.ones(24, np.float32)),        # unexpected
    ('decoder_blocks.0.mlp.fc1.weight', lambda cfg: np.zeros((48 * 4, 32), np.float32)),  # wrong shape
    ('encoder_pos_embed_learned', lambda cfg: np.zeros((1, 16, 32), np.float32)),        # no buffer
    ('fake_latent', lambda cfg: np.zeros((1, 48), np.float32)),                          # decoder width
])
def test_convert_rejects_bad_key_naming_it(key, make):
  cfg = mar.tiny()
  sd = edited(official_state_dict(cfg), key, None if make is None else make(cfg))
  with pytest.raises(ValueError, match=re.escape(key)):
    convert_mar(sd, cfg)


# ---- masking, label drop, dropout ----

def test_random_mask_counts_follow_the_truncated_ratio():
  cfg = mar.tiny(img_size=128)   # 256 tokens, as MAR-256
  counts = []
  for i in range(64):
    mask = np.asarray(random_mask(cfg, jax.random.key(i), 3))
    assert len(set(mask.sum(1))) == 1   # one ratio per batch
    counts.append(mask[0].sum())
  counts = np.array(counts)
  assert counts.min() >= math.ceil(0.7 * 256) and counts.max() <= 256
  # Mean of N(1, 0.25) truncated to [0.7, 1]: 1 + 0.25 (pdf(-1.2) - pdf(0)) / (cdf(0) - cdf(-1.2)) ~ 0.867.
  assert abs(counts.mean() / 256 - 0.867) < 0.03


def test_label_drop_only_in_training():
  cfg = mar.tiny(label_drop_prob=0.5, **EVAL)
  params = convert_mar(official_state_dict(cfg), cfg)
  tokens, labels, _ = inputs(cfg, batch=16)
  mask = fixed_mask(cfg, 16, n_masked=10)
  run = lambda uncond, **kw: encode_decode(cfg, params, tokens, mask, labels, uncond, gathered=False, **kw)[1]
  none, every = np.zeros(16, bool), np.ones(16, bool)
  cond, fake = run(none), run(every)
  np.testing.assert_array_equal(run(none, seed=3), cond)   # eval ignores the rng
  train = run(none, train=True, seed=3)
  is_cond = np.all(np.isclose(train, cond, rtol=1e-6, atol=1e-6), axis=(1, 2))
  is_fake = np.all(np.isclose(train, fake, rtol=1e-6, atol=1e-6), axis=(1, 2))
  assert np.all(is_cond ^ is_fake) and 0 < is_fake.sum() < 16


@pytest.mark.parametrize('attn_drop, proj_drop', [(0.5, 0.0), (0.0, 0.5)])
def test_block_dropout_only_in_training(attn_drop, proj_drop):
  """Each dropout site alone (attention probabilities; projections and MLP) acts in training only."""
  block = Block(16, 2, attn_drop=attn_drop, proj_drop=proj_drop)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 16)), jnp.float32)
  params = block.init(jax.random.key(0), x)

  @functools.partial(jax.jit, static_argnames='train')
  def run(seed, train):
    return block.apply(params, x, deterministic=not train, rngs={'dropout': jax.random.key(seed)})[0]
  eval1 = run(1, False)
  np.testing.assert_array_equal(run(2, False), eval1)
  train1, train2 = run(1, True), run(2, True)
  assert not np.allclose(train1, eval1) and not np.allclose(train1, train2)


# ---- patchify ----

def test_patchify_matches_official_channel_order_and_round_trips():
  cfg = mar.tiny(patch_size=2)   # 32 px / stride 8 / patch 2 -> 2 x 2 tokens of 4 * 2 * 2
  latents = np.random.default_rng(0).standard_normal((2, 4, 4, cfg.vae_embed_dim)).astype(np.float32)
  got = np.asarray(mar.patchify(cfg, jnp.asarray(latents)))
  nchw = latents.transpose(0, 3, 1, 2).reshape(2, cfg.vae_embed_dim, 2, 2, 2, 2)
  want = np.einsum('nchpwq->nhwcpq', nchw).reshape(2, 4, cfg.vae_embed_dim * 4)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(mar.unpatchify(cfg, jnp.asarray(got))), latents)


# ---- training ----

def test_loss_finite_and_decreases_on_fixed_batch():
  optax = pytest.importorskip('optax')
  # Small and without dropout (its random bits dominate XLA's CPU compile; tested above).
  cfg = mar.tiny(encoder_depth=1, diffloss_d=1, **EVAL)
  model = MAR(cfg)
  params = jax.tree_util.tree_map(jnp.asarray, convert_mar(official_state_dict(cfg), cfg))
  rng = np.random.default_rng(0)
  latents = jnp.asarray(rng.standard_normal((8, 4, 4, cfg.vae_embed_dim)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, cfg.class_num, 8))
  opt = optax.adam(1e-3)
  state = opt.init(params)
  key = jax.random.key(0)   # one mask, label drop, dropout and diffusion draw: a fixed objective

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(lambda p: mar.loss_fn(model, p, latents, labels, key))(params)
    updates, state = opt.update(grads, state)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(8):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0]
