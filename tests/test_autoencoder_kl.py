"""LDM/MAR AutoencoderKL: converter, posterior and attention against float64 NumPy, shapes, param counts."""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conv_state_dicts import conv, encoder_decoder
from state_dict_edits import edit as edit_state_dict

from var_models.convert.autoencoder_kl import convert_autoencoder_kl
from var_models.tokenizers.autoencoder_kl import KL16, SDXL_F8C4, AutoencoderKL, AutoencoderKLConfig, param_count
from var_models.tokenizers.conv_vae import AttnBlock

# z_channels != embed_dim so a swapped quant_conv / post_quant_conv shape cannot pass.
CFG = AutoencoderKLConfig(embed_dim=3, z_channels=4, ch=32, ch_mult=(1, 2), num_res_blocks=1,
                          encoder_attn=True, decoder_attn=True)
B = 2
# Counted on the official models/vae.py: AutoencoderKL(embed_dim=16, ch_mult=(1, 1, 2, 2, 4)) and
# AutoencoderKL(embed_dim=4, ch_mult=(1, 2, 4, 4)) (the latter is the SDXL VAE's architecture).
KL16_PARAMS = 66_456_019
SDXL_F8C4_PARAMS = 83_653_863


# ----- a synthetic checkpoint in the official layout (names and shapes as models/vae.py builds them) -----

def official_state_dict(cfg: AutoencoderKLConfig, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  sd: dict[str, np.ndarray] = {}
  cz, ce = cfg.z_channels, cfg.embed_dim
  encoder_decoder(sd, rng, ch=cfg.ch, ch_mult=cfg.ch_mult, num_res_blocks=cfg.num_res_blocks, z_out=2 * cz,
                  z_in=cz, encoder_attn=cfg.encoder_attn, decoder_attn=cfg.decoder_attn, mid_attn=cfg.mid_attn,
                  fused_qkv=False)
  conv(sd, rng, 'quant_conv', 2 * cz, 2 * ce, 1)
  conv(sd, rng, 'post_quant_conv', ce, cz, 1)
  return sd


@pytest.fixture(scope='module')
def converted():
  sd = official_state_dict(CFG)
  return sd, {'params': convert_autoencoder_kl(sd, CFG)}


@functools.lru_cache(maxsize=None)
def _jit(method):
  return jax.jit(functools.partial(AutoencoderKL(CFG).apply, method=method))


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  return {jax.tree_util.keystr(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _init_shapes(cfg: AutoencoderKLConfig, size: int) -> dict:
  img = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
  return jax.eval_shape(lambda x: AutoencoderKL(cfg).init(jax.random.key(0), x, jax.random.key(1)), img)['params']


# ----- converter -----

@pytest.mark.parametrize('enc_attn,dec_attn,mid_attn', [(True, False, True), (False, False, True),
                                                        (True, True, True), (False, False, False)])
def test_converted_tree_matches_init(enc_attn, dec_attn, mid_attn):
  cfg = dataclasses.replace(CFG, encoder_attn=enc_attn, decoder_attn=dec_attn, mid_attn=mid_attn)
  params = convert_autoencoder_kl(official_state_dict(cfg), cfg)
  assert _shapes(params) == _shapes(_init_shapes(cfg, 8))
  assert all(np.asarray(x).dtype == np.float32 for x in jax.tree_util.tree_leaves(params))


def test_conv_layouts(converted):
  sd, variables = converted
  p = variables['params']
  np.testing.assert_array_equal(p['encoder']['down_1_attn_0']['k']['kernel'],
                                sd['encoder.down.1.attn.0.k.weight'][:, :, 0, 0].T)
  np.testing.assert_array_equal(p['post_quant_conv']['kernel'][0, 0], sd['post_quant_conv.weight'][:, :, 0, 0].T)
  np.testing.assert_array_equal(p['decoder']['conv_in']['kernel'][2, 1], sd['decoder.conv_in.weight'][:, :, 2, 1].T)


@pytest.mark.parametrize('edit,key', [
    ('drop', 'encoder.down.1.attn.0.q.weight'),
    ('drop', 'post_quant_conv.bias'),
    ('extra', 'decoder.mid.attn_1.qkv.weight'),
    ('extra', 'model_ema.decay'),
    ('reshape', 'quant_conv.weight'),
    ('reshape', 'decoder.up.0.block.0.nin_shortcut.weight'),
])
def test_bad_checkpoint_names_the_key(edit, key):
  sd = edit_state_dict(official_state_dict(CFG), edit, key)
  with pytest.raises(ValueError, match=re.escape(key)):
    convert_autoencoder_kl(sd, CFG)


def test_loss_modules_are_ignored(converted):
  sd, variables = converted
  extra = {'loss.logvar': np.zeros(()), 'loss.discriminator.main.0.weight': np.zeros((8, 3, 4, 4))}
  params = convert_autoencoder_kl({**sd, **extra}, CFG)
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, variables['params'])


# ----- against float64 NumPy (official formulas, torch-layout weights) -----

def _np_group_norm(x, w, b, groups=32, eps=1e-6):
  bb, hh, ww, c = x.shape
  g = x.reshape(bb, hh, ww, groups, c // groups)
  g = (g - g.mean(axis=(1, 2, 4), keepdims=True)) / np.sqrt(g.var(axis=(1, 2, 4), keepdims=True) + eps)
  return g.reshape(x.shape) * w + b


def _np_conv1x1(x, sd, name):
  return np.einsum('bhwi,oi->bhwo', x, sd[f'{name}.weight'][:, :, 0, 0].astype(np.float64)) + sd[f'{name}.bias']


def _np_attn(x, sd, name):
  """The official AttnBlock: one head over all positions, softmax(q k^T / sqrt(C)) v, residual."""
  bb, hh, ww, c = x.shape
  h = _np_group_norm(x, sd[f'{name}.norm.weight'], sd[f'{name}.norm.bias'])
  q, k, v = (_np_conv1x1(h, sd, f'{name}.{n}').reshape(bb, hh * ww, c) for n in 'qkv')
  s = np.einsum('bic,bjc->bij', q, k) / np.sqrt(c)
  p = np.exp(s - s.max(-1, keepdims=True))
  o = np.einsum('bij,bjc->bic', p / p.sum(-1, keepdims=True), v).reshape(x.shape)
  return x + _np_conv1x1(o, sd, f'{name}.proj_out')


def test_attention_block_matches_float64(converted):
  sd, variables = converted
  x = np.random.default_rng(1).normal(size=(B, 3, 5, 2 * CFG.ch))
  p = variables['params']['encoder']['down_1_attn_0']
  got = AttnBlock().apply({'params': p}, jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(got, _np_attn(x, sd, 'encoder.down.1.attn.0'), rtol=1e-4, atol=1e-4)


def test_posterior_matches_float64_and_clamps_logvar(converted):
  sd, variables = converted
  ce = CFG.embed_dim
  sd = dict(sd)
  bias = sd['quant_conv.bias'].copy()
  bias[ce:] = [60.0, -60.0, 0.0]  # logvar channels: above, below and inside [-30, 20]
  sd['quant_conv.bias'] = bias
  v = {'params': convert_autoencoder_kl(sd, CFG)}
  img = jnp.asarray(np.random.default_rng(2).uniform(-1, 1, size=(B, 8, 8, 3)), jnp.float32)
  both = lambda m, x: (m.encoder(x), m.encode(x))  # one compile for the encoder output and the posterior
  h, (mean, logvar) = jax.jit(functools.partial(AutoencoderKL(CFG).apply, method=both))(v, img)
  moments = _np_conv1x1(np.asarray(h, np.float64), sd, 'quant_conv')
  np.testing.assert_allclose(mean, moments[..., :ce], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logvar, np.clip(moments[..., ce:], -30, 20), rtol=1e-5, atol=1e-5)
  assert np.all(logvar[..., 0] == 20) and np.all(logvar[..., 1] == -30)


def test_decode_applies_post_quant_conv_first(converted):
  sd, variables = converted
  z = np.random.default_rng(3).normal(size=(B, 4, 4, CFG.embed_dim))
  zq = _np_conv1x1(z, sd, 'post_quant_conv')
  both = lambda m, a, b: (m.decode(a), m.decoder(b))
  got, want = jax.jit(functools.partial(AutoencoderKL(CFG).apply, method=both))(
      variables, jnp.asarray(z, jnp.float32), jnp.asarray(zq, jnp.float32))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----- shapes, sampling, the training forward -----

def test_sample_is_mean_plus_std_eps(converted):
  _, variables = converted
  rng = np.random.default_rng(5)
  mean = jnp.asarray(rng.normal(size=(B, 4, 4, 3)), jnp.float32)
  logvar = jnp.asarray(rng.uniform(-3, 1, size=(B, 4, 4, 3)), jnp.float32)
  key = jax.random.key(7)
  got = _jit(AutoencoderKL.sample)(variables, mean, logvar, key)
  eps = jax.random.normal(key, mean.shape)
  np.testing.assert_allclose(got, mean + np.exp(0.5 * np.asarray(logvar)) * eps, rtol=1e-6, atol=1e-6)
  assert not np.allclose(got, _jit(AutoencoderKL.sample)(variables, mean, logvar, jax.random.key(8)))


def test_training_forward_shapes_and_sample(converted):
  _, variables = converted
  img = jnp.asarray(np.random.default_rng(4).uniform(-1, 1, size=(B, 8, 12, 3)), jnp.float32)
  by_parts = lambda m, x, key: m.decode(m.sample(*m.encode(x), key))
  both = lambda m, x, key: (m(x, key), by_parts(m, x, key))  # one compile
  (rec, mean, logvar), want = jax.jit(functools.partial(AutoencoderKL(CFG).apply, method=both))(
      variables, img, jax.random.key(9))
  assert mean.shape == logvar.shape == (B, 4, 6, CFG.embed_dim) and mean.dtype == jnp.float32
  assert rec.shape == img.shape
  np.testing.assert_allclose(rec, want, rtol=1e-5, atol=1e-5)


# ----- the real configurations, shapes only -----

@pytest.mark.parametrize('cfg,total,latent', [(KL16, KL16_PARAMS, (16, 16, 16)),
                                              (SDXL_F8C4, SDXL_F8C4_PARAMS, (32, 32, 4))])
def test_real_config_shapes_and_param_count(cfg, total, latent):
  assert param_count(cfg) == total
  img = jax.ShapeDtypeStruct((1, 256, 256, 3), jnp.float32)
  params = _init_shapes(cfg, 256)
  mean, _ = jax.eval_shape(lambda p, x: AutoencoderKL(cfg).apply({'params': p}, x, method=AutoencoderKL.encode),
                           params, img)
  assert mean.shape == (1, *latent)
  assert params['quant_conv']['kernel'].shape == (1, 1, 2 * cfg.z_channels, 2 * cfg.embed_dim)
  assert params['post_quant_conv']['kernel'].shape == (1, 1, cfg.embed_dim, cfg.z_channels)
  level_attn = lambda tree: sorted(k for k in tree if '_attn_' in k)
  last = len(cfg.ch_mult) - 1
  assert level_attn(params['encoder']) == ([f'down_{last}_attn_{j}' for j in range(2)] if cfg is KL16 else [])
  assert level_attn(params['decoder']) == []
  assert 'attn_1' in params['encoder']['mid'] and 'attn_1' in params['decoder']['mid']
