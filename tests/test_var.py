"""VAR: official parameter counts and init, the converter against a float64 NumPy
re-implementation of the official forward, the scale-causal mask, label dropout, training."""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from state_dict_edits import edited

from var_models.convert.var import convert_var, infer_var_depth
from var_models.var.model import VAR, VARConfig, cross_entropy, init_params, loss_fn, param_count

# Counted on the official torch model (models/var.py, built as build_vae_var does).
OFFICIAL_PARAMS = {16: 310_283_520, 20: 600_917_136, 24: 1_033_399_360, 30: 2_010_020_356}


def tiny(**kw) -> VARConfig:
  base = dict(depth=2, width=32, num_heads=2, num_classes=5, vocab_size=16, cvae=4, patch_nums=(1, 2, 3),
              drop_path_rate=0.0)
  return VARConfig(**{**base, **kw})


def official_state_dict(cfg: VARConfig, seed: int = 0) -> dict:
  """Random weights under the official names and torch layouts (Linear [out, in]), with
  the buffers a checkpoint may carry. Scales keep activations O(1) so every term matters."""
  rng = np.random.default_rng(seed)
  c, h, s = cfg.width, cfg.num_heads, cfg.schedule
  hid = round(c * cfg.mlp_ratio)
  shapes = {'word_embed.weight': (c, cfg.cvae), 'word_embed.bias': (c,), 'class_emb.weight': (cfg.num_classes + 1, c),
            'pos_start': (1, s.first_l, c), 'pos_1LC': (1, s.L, c), 'lvl_embed.weight': (s.num_scales, c),
            'head_nm.ada_lin.1.weight': (2 * c, c), 'head_nm.ada_lin.1.bias': (2 * c,),
            'head.weight': (cfg.vocab_size, c), 'head.bias': (cfg.vocab_size,)}
  if cfg.shared_aln:
    shapes.update({'shared_ada_lin.1.weight': (6 * c, c), 'shared_ada_lin.1.bias': (6 * c,)})
  for i in range(cfg.depth):
    b = f'blocks.{i}.'
    shapes.update({b + 'attn.mat_qkv.weight': (3 * c, c), b + 'attn.q_bias': (c,), b + 'attn.v_bias': (c,),
                   b + 'attn.proj.weight': (c, c), b + 'attn.proj.bias': (c,),
                   b + 'ffn.fc1.weight': (hid, c), b + 'ffn.fc1.bias': (hid,),
                   b + 'ffn.fc2.weight': (c, hid), b + 'ffn.fc2.bias': (c,)})
    shapes.update({b + 'ada_gss': (1, 1, 6, c)} if cfg.shared_aln else
                  {b + 'ada_lin.1.weight': (6 * c, c), b + 'ada_lin.1.bias': (6 * c,)})
  sd = {}
  for k, shape in shapes.items():
    std = 1 / math.sqrt(shape[1]) if k.endswith('weight') and len(shape) == 2 and 'emb' not in k else 0.3
    sd[k] = (rng.standard_normal(shape) * std).astype(np.float32)
  levels = s.level_ids()
  for i in range(cfg.depth):
    if cfg.attn_l2_norm:
      sd[f'blocks.{i}.attn.scale_mul_1H11'] = (math.log(4) + 0.5 * rng.standard_normal((1, h, 1, 1))).astype(np.float32)
    sd[f'blocks.{i}.attn.zero_k_bias'] = np.zeros((c,), np.float32)
  sd['lvl_1L'] = levels[None].astype(np.int64)
  sd['attn_bias_for_masking'] = np.where(levels[:, None] >= levels[None], 0, -np.inf)[None, None].astype(np.float32)
  return sd


def ref_forward(sd: dict, cfg: VARConfig, labels: np.ndarray, x_tf: np.ndarray) -> np.ndarray:
  """Official VAR.forward (eval, no label dropout) in float64 NumPy, straight from the state dict."""
  g = lambda k: np.asarray(sd[k], np.float64)
  lin = lambda x, pre, bias=True: x @ g(pre + '.weight').T + (g(pre + '.bias') if bias else 0)
  silu = lambda x: x / (1 + np.exp(-x))
  gelu = lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

  def ln(x):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + cfg.norm_eps)

  def attn(x, pre):
    bsz, n, c = x.shape
    hd = c // cfg.num_heads
    qkv = x @ g(pre + '.mat_qkv.weight').T + np.concatenate([g(pre + '.q_bias'), np.zeros(c), g(pre + '.v_bias')])
    q, k, v = qkv.reshape(bsz, n, 3, cfg.num_heads, hd).transpose(2, 0, 3, 1, 4)   # each [B, H, L, hd]
    scale = 0.25 / math.sqrt(hd)
    if cfg.attn_l2_norm:
      unit = lambda t: t / np.maximum(np.linalg.norm(t, axis=-1, keepdims=True), 1e-12)
      q, k, scale = unit(q) * np.exp(np.minimum(g(pre + '.scale_mul_1H11'), math.log(100))), unit(k), 1.0
    a = q @ k.swapaxes(-1, -2) * scale + mask_bias
    a = np.exp(a - a.max(-1, keepdims=True))
    out = (a / a.sum(-1, keepdims=True)) @ v
    return lin(out.transpose(0, 2, 1, 3).reshape(bsz, n, c), pre + '.proj')

  s, c, bsz = cfg.schedule, cfg.width, len(labels)
  levels = s.level_ids()
  mask_bias = np.where(levels[:, None] >= levels[None], 0.0, -np.inf)
  cond = g('class_emb.weight')[labels]
  sos = np.broadcast_to(cond[:, None] + g('pos_start'), (bsz, s.first_l, c))
  x = np.concatenate([sos, lin(np.asarray(x_tf, np.float64), 'word_embed')], 1)
  x = x + g('lvl_embed.weight')[levels][None] + g('pos_1LC')
  for i in range(cfg.depth):
    pre = f'blocks.{i}'
    if cfg.shared_aln:
      mod = g(pre + '.ada_gss') + lin(silu(cond), 'shared_ada_lin.1').reshape(bsz, 1, 6, c)
    else:
      mod = lin(silu(cond), pre + '.ada_lin.1').reshape(bsz, 1, 6, c)
    g1, g2, s1, s2, b1, b2 = (mod[:, :, j] for j in range(6))
    x = x + attn(ln(x) * (1 + s1) + b1, pre + '.attn') * g1
    x = x + lin(gelu(lin(ln(x) * (1 + s2) + b2, pre + '.ffn.fc1')), pre + '.ffn.fc2') * g2
  scale, shift = lin(silu(cond), 'head_nm.ada_lin.1').reshape(bsz, 1, 2, c).transpose(2, 0, 1, 3)
  return lin(ln(x) * (1 + scale) + shift, 'head')


def inputs(cfg: VARConfig, batch: int = 3, seed: int = 1):
  rng = np.random.default_rng(seed)
  s = cfg.schedule
  labels = rng.integers(0, cfg.num_classes + 1, batch)   # includes the unconditional class
  x_tf = rng.standard_normal((batch, s.L - s.first_l, cfg.cvae)).astype(np.float32)
  return labels, x_tf


# Jitted: one compile is cheaper than dispatching every op eagerly on CPU.
init = jax.jit(init_params, static_argnums=0)


@functools.partial(jax.jit, static_argnames=('cfg', 'train'))
def _forward(params, labels, x_tf, key, cfg, train):
  return VAR(cfg).apply({'params': params}, labels, x_tf, train=train, rngs={'dropout': key})


def forward(cfg: VARConfig, params, labels, x_tf, *, train: bool = False, seed: int = 0) -> np.ndarray:
  """Teacher-forced logits [B, L, V]; `seed` drives label dropout when training."""
  return np.asarray(_forward(params, jnp.asarray(labels), jnp.asarray(x_tf), jax.random.key(seed), cfg, train))


def rel_err(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def shapes_of(tree):
  return jax.tree_util.tree_map(lambda a: tuple(a.shape), tree)


# ---- parameter counts and initialisation ----

@pytest.mark.parametrize('depth', sorted(OFFICIAL_PARAMS))
def test_param_count_matches_official(depth):
  cfg = VARConfig(depth=depth)
  shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
  assert param_count(shapes) == OFFICIAL_PARAMS[depth]


def test_init_statistics_follow_official_init_weights():
  cfg = VARConfig(depth=2, width=128, num_heads=2, num_classes=10, vocab_size=512, cvae=8, patch_nums=(1, 2))
  p = jax.device_get(init(cfg, jax.random.key(0)))
  std = math.sqrt(1 / (3 * cfg.width))
  close = lambda x, want: abs(float(np.std(x)) / want - 1) < 0.1
  assert close(p['word_embed']['kernel'], std) and close(p['class_emb']['embedding'], std)
  assert close(p['pos_1LC'], std) and close(p['lvl_embed']['embedding'], std)
  assert close(p['head']['kernel'], std * cfg.init_head)
  assert close(p['head_nm']['ada_lin']['kernel'], std * cfg.init_adaln)
  c = cfg.width
  for i in range(cfg.depth):
    blk = p[f'blocks_{i}']
    assert close(blk['attn']['mat_qkv']['kernel'], std) and close(blk['ffn']['fc1']['kernel'], std)
    assert close(blk['attn']['proj']['kernel'], std / math.sqrt(2 * cfg.depth))
    assert close(blk['ffn']['fc2']['kernel'], std / math.sqrt(2 * cfg.depth))
    ada = blk['ada_lin']['kernel']   # columns: gamma1, gamma2 | scale1, scale2, shift1, shift2
    assert close(ada[:, :2 * c], std * cfg.init_adaln_gamma) and close(ada[:, 2 * c:], std * cfg.init_adaln)
    np.testing.assert_allclose(blk['attn']['scale_mul'], math.log(4), rtol=1e-6)
    for leaf in (blk['attn']['q_bias'], blk['attn']['v_bias'], blk['attn']['proj']['bias'], blk['ada_lin']['bias'],
                 blk['ffn']['fc1']['bias'], blk['ffn']['fc2']['bias']):
      assert not np.any(leaf)
  assert not np.any(p['head']['bias']) and not np.any(p['head_nm']['ada_lin']['bias'])
  assert not np.any(p['word_embed']['bias'])
  assert np.max(np.abs(p['pos_1LC'])) <= 2.0   # torch trunc_normal_ bound is absolute


def test_shared_aln_init_scales_gss_rows():
  cfg = VARConfig(depth=1, width=512, num_heads=2, num_classes=4, vocab_size=8, cvae=4, patch_nums=(1, 2),
                  shared_aln=True, init_adaln_gamma=1e-3)
  gss = np.asarray(init(cfg, jax.random.key(0))['blocks_0']['ada_gss'])
  base = 1 / math.sqrt(cfg.width)
  assert abs(np.std(gss[:2]) / (base * 1e-3) - 1) < 0.1 and abs(np.std(gss[2:]) / (base * 0.5) - 1) < 0.1


# ---- converter ----

CONVERT_CASES = {'plain': {}, 'shared_aln': {'shared_aln': True}, 'no_l2_norm': {'attn_l2_norm': False}}


@pytest.mark.parametrize('case', sorted(CONVERT_CASES))
def test_converted_logits_match_numpy_reference(case):
  cfg = tiny(**CONVERT_CASES[case])
  sd = official_state_dict(cfg)
  params = convert_var(sd, cfg)
  assert shapes_of(params) == shapes_of(jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0)))
  labels, x_tf = inputs(cfg)
  got = forward(cfg, params, labels, x_tf)
  want = ref_forward(sd, cfg, labels, x_tf)
  assert got.shape == want.shape == (3, cfg.schedule.L, cfg.vocab_size)
  assert rel_err(got, want) < 1e-5


def test_convert_accepts_ddp_prefix_and_missing_buffers():
  cfg = tiny()
  sd = official_state_dict(cfg)
  want = convert_var(sd, cfg)
  no_buffers = {k: v for k, v in sd.items() if not re.search(r'lvl_1L|attn_bias_for_masking|zero_k_bias', k)}
  for variant in ({'module.' + k: v for k, v in sd.items()}, no_buffers):
    got = convert_var(variant, cfg)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_infer_var_depth():
  assert infer_var_depth(official_state_dict(tiny(depth=3))) == 3
  with pytest.raises(ValueError, match='not 0..n-1'):
    infer_var_depth({'blocks.0.x': 0, 'blocks.2.x': 0})
  with pytest.raises(ValueError, match='no blocks'):
    infer_var_depth({'head.weight': 0})


@pytest.mark.parametrize('key, make', [
    ('blocks.1.attn.q_bias', None),                                                  # missing
    ('blocks.0.attn.k_bias', lambda c: np.zeros(c, np.float32)),                     # unexpected
    ('blocks.0.ffn.fc1.weight', lambda c: np.zeros((4 * c, c + 1), np.float32)),     # wrong shape
    ('pos_1LC', lambda c: np.zeros((1, 13, c), np.float32)),                         # wrong L
    ('blocks.0.attn.scale_mul_1H11', lambda c: np.zeros((1, 3, 1, 1), np.float32)),  # wrong heads
    ('blocks.1.attn.zero_k_bias', lambda c: np.ones(c, np.float32)),                 # not a zero buffer
    ('lvl_1L', lambda c: np.array([[0] + [1] * 5 + [2] * 8])),                     # other schedule
    ('blocks.1.ada_gss', lambda c: np.zeros((1, 1, 6, c), np.float32)),              # shared_aln layout
])
def test_convert_rejects_bad_key_naming_it(key, make):
  cfg = tiny()
  sd = edited(official_state_dict(cfg), key, None if make is None else make(cfg.width))
  with pytest.raises(ValueError, match=re.escape(key)):
    convert_var(sd, cfg)


def test_convert_rejects_depth_and_l2_norm_mismatch():
  sd = official_state_dict(tiny())
  with pytest.raises(ValueError, match='2 blocks.*depth is 3'):
    convert_var(sd, tiny(depth=3))
  with pytest.raises(ValueError, match='scale_mul_1H11'):
    convert_var(sd, tiny(attn_l2_norm=False))


# ---- model behaviour ----

def test_label_dropout_only_in_train():
  cfg = tiny(cond_drop_rate=0.5)
  params = convert_var(official_state_dict(cfg), cfg)
  labels, x_tf = inputs(cfg, batch=16)
  labels = labels % cfg.num_classes   # all conditional
  run = lambda lab, **kw: forward(cfg, params, lab, x_tf, **kw)
  cond, uncond = run(labels), run(np.full_like(labels, cfg.num_classes))
  np.testing.assert_array_equal(run(labels, seed=3), cond)   # eval ignores the rng
  train = run(labels, train=True, seed=3)
  is_cond = np.all(np.isclose(train, cond, rtol=1e-6, atol=1e-6), axis=(1, 2))
  is_uncond = np.all(np.isclose(train, uncond, rtol=1e-6, atol=1e-6), axis=(1, 2))
  assert np.all(is_cond ^ is_uncond) and 0 < is_uncond.sum() < len(labels)


def test_scale_causal_mask_blocks_the_future():
  cfg = tiny(patch_nums=(1, 2, 3, 4))
  params = convert_var(official_state_dict(cfg), cfg)
  labels, x_tf = inputs(cfg)
  fwd = lambda x: forward(cfg, params, labels, x)
  base = fwd(x_tf)
  s = cfg.schedule
  for si in range(1, s.num_scales):
    begin, end = s.begin_ends[si]
    x2 = x_tf.copy()
    x2[:, begin - s.first_l:end - s.first_l] += 1.0   # inputs of scale si only
    out = fwd(x2)
    np.testing.assert_array_equal(out[:, :begin], base[:, :begin])
    assert np.all(np.abs(out[:, begin:] - base[:, begin:]).max(-1) > 0)


def test_loss_finite_and_decreases_on_fixed_batch():
  optax = pytest.importorskip('optax')
  cfg = tiny(depth=1, cond_drop_rate=0.1, drop_path_rate=0.05)   # depth 1: XLA's CPU compile dominates
  model = VAR(cfg)
  params = jax.tree_util.tree_map(jnp.asarray, convert_var(official_state_dict(cfg), cfg))
  labels, x_tf = inputs(cfg, batch=4)
  targets = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (4, cfg.schedule.L)))
  opt = optax.adam(3e-3)
  state = opt.init(params)

  @jax.jit
  def step(params, state, key):
    (loss, _), grads = jax.value_and_grad(
        lambda p: loss_fn(model, p, jnp.asarray(labels), jnp.asarray(x_tf), targets, train=True, rng=key),
        has_aux=True)(params)
    updates, state = opt.update(grads, state)
    return optax.apply_updates(params, updates), state, loss

  eval_loss = lambda p: float(cross_entropy(forward(cfg, p, labels, x_tf), targets))
  first = eval_loss(params)
  assert np.isfinite(first)
  for i in range(8):
    params, state, loss = step(params, state, jax.random.key(i))
    assert np.isfinite(float(loss))
  assert eval_loss(params) < first - 0.1


def test_cross_entropy_matches_log_softmax():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 5)), jnp.float32)
  targets = jnp.asarray([[0, 1, 4], [2, 2, 3]])
  logp = jax.nn.log_softmax(logits)
  want = -np.mean([logp[b, l, targets[b, l]] for b in range(2) for l in range(3)])
  np.testing.assert_allclose(cross_entropy(logits, targets), want, rtol=1e-6)
