"""VAR's multi-scale VQVAE: converter, quantizer against a float64 NumPy reference, round trips."""
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

from var_models.convert.vqvae import convert_vqvae
from var_models.nn.resample import area_matrix, bicubic_matrix
from var_models.tokenizers.vqvae import VQVAE, VQVAEConfig, phi_index

CFG = VQVAEConfig(vocab_size=64, z_channels=8, ch=32, ch_mult=(1, 2), num_res_blocks=1,
                  patch_nums=(1, 2, 3, 4))
B = 2


# ----- a synthetic checkpoint in the official layout (names and shapes as models/vqvae.py builds them) -----

def official_state_dict(cfg: VQVAEConfig, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  sd: dict[str, np.ndarray] = {}
  cz = cfg.z_channels
  encoder_decoder(sd, rng, ch=cfg.ch, ch_mult=cfg.ch_mult, num_res_blocks=cfg.num_res_blocks, z_out=cz, z_in=cz,
                  encoder_attn=cfg.using_sa, decoder_attn=cfg.using_sa, mid_attn=cfg.using_mid_sa, fused_qkv=True)
  conv(sd, rng, 'quant_conv', cz, cz, 3)
  conv(sd, rng, 'post_quant_conv', cz, cz, 3)
  sd['quantize.embedding.weight'] = rng.normal(size=(cfg.vocab_size, cz)).astype(np.float32)
  sd['quantize.ema_vocab_hit_SV'] = np.zeros((cfg.num_scales, cfg.vocab_size), np.float32)
  phi_names = {0: [f'quantize.quant_resi.{k}' for k in range(cfg.num_scales)],
               1: ['quantize.quant_resi.qresi']}.get(
                   cfg.share_quant_resi, [f'quantize.quant_resi.qresi_ls.{k}' for k in range(cfg.share_quant_resi)])
  for name in phi_names if abs(cfg.quant_resi) > 1e-6 else []:
    conv(sd, rng, name, cz, cz, 3)
  return sd


@pytest.fixture(scope='module')
def converted():
  sd = official_state_dict(CFG)
  return sd, {'params': convert_vqvae(sd, CFG)}


def _apply(variables, method, *args, cfg=CFG):
  return VQVAE(cfg).apply(variables, *args, method=method)


@functools.lru_cache(maxsize=None)
def _jit(method, cfg=CFG):
  return jax.jit(functools.partial(VQVAE(cfg).apply, method=method))


@functools.lru_cache(maxsize=None)
def _quantizer(cfg=CFG):
  """jitted (variables, f) -> (per-scale indices, per-scale f_hat), one compile for both."""
  model = VQVAE(cfg)
  return jax.jit(lambda v, f: (model.apply(v, f, method=VQVAE.f_to_indices),
                                model.apply(v, f, method=VQVAE.f_to_fhats)))


# ----- converter -----

def _shapes(tree) -> dict[str, tuple[int, ...]]:
  return {jax.tree_util.keystr(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize('share,quant_resi', [(4, 0.5), (1, 0.5), (0, 0.5), (3, -0.5), (4, 0.0)])
def test_converted_tree_matches_init(share, quant_resi):
  cfg = dataclasses.replace(CFG, share_quant_resi=share, quant_resi=quant_resi)
  params = convert_vqvae(official_state_dict(cfg), cfg)
  img = jnp.zeros((1, 8, 8, 3))
  init = jax.eval_shape(lambda: VQVAE(cfg).init(jax.random.key(0), img))['params']
  assert _shapes(params) == _shapes(init)
  assert all(np.asarray(x).dtype == np.float32 for x in jax.tree_util.tree_leaves(params))


def test_attention_qkv_split_and_conv_layout(converted):
  sd, variables = converted
  p = variables['params']
  qkv = sd['encoder.mid.attn_1.qkv.weight'][:, :, 0, 0]
  c = qkv.shape[1]
  np.testing.assert_array_equal(p['encoder']['mid']['attn_1']['k']['kernel'], qkv[c:2 * c].T)
  np.testing.assert_array_equal(p['encoder']['mid']['attn_1']['v']['bias'], sd['encoder.mid.attn_1.qkv.bias'][2 * c:])
  np.testing.assert_array_equal(p['quant_conv']['kernel'][0, 2], sd['quant_conv.weight'][:, :, 0, 2].T)


@pytest.mark.parametrize('edit,key', [
    ('drop', 'quantize.quant_resi.qresi_ls.2.bias'),
    ('drop', 'encoder.mid.attn_1.qkv.weight'),
    ('extra', 'decoder.up.0.attn.0.qkv.weight'),
    ('reshape', 'decoder.up.1.block.0.conv1.weight'),
    ('reshape', 'quantize.embedding.weight'),
])
def test_bad_checkpoint_names_the_key(edit, key):
  sd = edit_state_dict(official_state_dict(CFG), edit, key)
  with pytest.raises(ValueError, match=re.escape(key)):
    convert_vqvae(sd, CFG)


def test_shape_error_reports_both_shapes():
  sd = official_state_dict(CFG)
  sd['post_quant_conv.weight'] = np.zeros((8, 8, 1, 1), np.float32)
  with pytest.raises(ValueError, match=r'\(8, 8, 1, 1\).*\(8, 8, 3, 3\)'):
    convert_vqvae(sd, CFG)


# ----- quantizer against float64 NumPy (official algorithm, torch-layout weights) -----

def _np_conv3(x, w, b):
  """x [B, H, W, I] float64, w torch OIHW: cross-correlation with zero padding 1."""
  hh, ww = x.shape[1:3]
  xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  out = sum(np.einsum('bhwi,oi->bhwo', xp[:, dy:dy + hh, dx:dx + ww], w[:, :, dy, dx].astype(np.float64))
            for dy in range(3) for dx in range(3))
  return out + b


def _np_resize(x, n, matrix):
  m = matrix(x.shape[1], n).astype(np.float64)
  return np.einsum('oh,pw,bhwc->bopc', m, m, x)


def _np_residual_quantize(f, sd, phi_of_scale):
  pns, e = CFG.patch_nums, sd['quantize.embedding.weight'].astype(np.float64)
  f_rest, f_hat, idxs = f.copy(), np.zeros_like(f), []
  for si, pn in enumerate(pns):
    z = f_rest if si == len(pns) - 1 else _np_resize(f_rest, pn, area_matrix)
    z = z.reshape(-1, z.shape[-1])
    d = (z ** 2).sum(1, keepdims=True) + (e ** 2).sum(1) - 2 * z @ e.T
    idx = d.argmin(1).reshape(f.shape[0], pn * pn)
    h = e[idx].reshape(f.shape[0], pn, pn, -1)
    if si != len(pns) - 1:
      h = _np_resize(h, pns[-1], bicubic_matrix)
    name = f'quantize.quant_resi.qresi_ls.{phi_of_scale[si]}'
    h = 0.5 * h + 0.5 * _np_conv3(h, sd[f'{name}.weight'], sd[f'{name}.bias'])
    f_hat, f_rest = f_hat + h, f_rest - h
    idxs.append(idx)
  return idxs, f_hat


def test_quantizer_matches_float64_reference(converted):
  sd, variables = converted
  f = np.random.default_rng(1).normal(size=(B, 4, 4, CFG.z_channels))
  want_idx, want_fhat = _np_residual_quantize(f, sd, phi_of_scale=[0, 1, 2, 3])
  got_idx, got_fhats = _quantizer()(variables, jnp.asarray(f, jnp.float32))
  got_fhat = got_fhats[-1]
  for got, want in zip(got_idx, want_idx):
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
  assert len({int(i) for idx in want_idx for i in idx.ravel()}) > 5  # not a degenerate argmin
  np.testing.assert_allclose(got_fhat, want_fhat, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('num_scales,k,want', [
    (4, 4, [0, 1, 2, 3]), (4, 3, [0, 0, 1, 2]), (4, 1, [0, 0, 0, 0]),
    (10, 4, [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]), (10, 10, list(range(10))),
    (13, 6, [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 5, 5]),
])
def test_phi_index_matches_official_ticks(num_scales, k, want):
  # Expected lists were produced by the official PhiPartiallyShared / PhiNonShared (exact ties included).
  assert [phi_index(si, num_scales, k) for si in range(num_scales)] == want


@pytest.mark.parametrize('znorm', [False, True])
def test_first_scale_nearest_code(converted, znorm):
  """Scale 0 quantizes the spatial mean of f: Euclidean argmin, or cosine argmax with using_znorm."""
  sd, variables = converted
  cfg = dataclasses.replace(CFG, using_znorm=znorm)
  f = np.random.default_rng(2).normal(size=(8, 4, 4, CFG.z_channels)).astype(np.float32)
  e = sd['quantize.embedding.weight'].astype(np.float64)
  z = f.astype(np.float64).mean(axis=(1, 2))
  unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
  want = (unit(z) @ unit(e).T).argmax(1) if znorm else ((z[:, None] - e[None]) ** 2).sum(-1).argmin(1)
  got = _quantizer(cfg)(variables, jnp.asarray(f))[0][0]
  np.testing.assert_array_equal(got[:, 0], want)


# ----- round trips and the VAR interfaces -----

def test_indices_fhat_indices_round_trip(converted):
  """With phi = identity, f = codebook vectors at full res whose coarse averages are nearest the zero code."""
  _, variables = converted
  cfg = dataclasses.replace(CFG, quant_resi=0.0)
  cz = cfg.z_channels
  signed_axes = np.concatenate([np.eye(cz), -np.eye(cz)])  # 16 codes: every area window averages >= 4 of them
  far = 100 * np.random.default_rng(3).normal(size=(cfg.vocab_size - 17, cz))
  table = np.concatenate([np.zeros((1, cz)), signed_axes, far]).astype(np.float32)
  params = {k: v for k, v in variables['params'].items() if not k.startswith('quant_resi')}
  params['embedding'] = {'embedding': table}
  v = {'params': params}
  last = np.stack([np.random.default_rng(s).permutation(16) + 1 for s in range(B)]).astype(np.int32)
  want = [np.zeros((B, pn * pn), np.int32) for pn in cfg.patch_nums[:-1]] + [last]
  f_hat = _apply(v, VQVAE.indices_to_fhat, want, cfg=cfg)
  np.testing.assert_array_equal(f_hat, table[last].reshape(B, 4, 4, cz))
  for got, w in zip(_quantizer(cfg)(v, f_hat)[0], want):
    np.testing.assert_array_equal(got, w)


def test_fhat_of_indices_equals_quantizer_fhat(converted):
  _, variables = converted
  f = jnp.asarray(np.random.default_rng(4).normal(size=(B, 4, 4, CFG.z_channels)), jnp.float32)
  idx, f_hats = _quantizer()(variables, f)
  from_idx = _apply(variables, VQVAE.indices_to_fhat, idx, True)
  assert [x.shape for x in idx] == [(B, pn * pn) for pn in CFG.patch_nums]
  for a, b in zip(from_idx, f_hats):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_img_to_indices_deterministic(converted):
  _, variables = converted
  img = jnp.asarray(np.random.default_rng(5).uniform(-1, 1, size=(B, 8, 8, 3)), jnp.float32)
  a, b = _jit(VQVAE.img_to_indices)(variables, img), _jit(VQVAE.img_to_indices)(variables, img)
  c = _quantizer()(variables, _jit(VQVAE.encode)(variables, img))[0]  # separately compiled path
  assert [x.shape for x in a] == [(B, pn * pn) for pn in CFG.patch_nums]
  for x, y, z in zip(a, b, c):
    np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(x, z)
  out = _jit(VQVAE.indices_to_img)(variables, a)
  assert out.shape == img.shape and float(jnp.max(jnp.abs(out))) <= 1.0


def test_teacher_forcing_equals_sampler_chain(converted):
  _, variables = converted
  pns, cz = CFG.patch_nums, CFG.z_channels
  rng = np.random.default_rng(6)
  idx = [jnp.asarray(rng.integers(0, CFG.vocab_size, size=(B, pn * pn)), jnp.int32) for pn in pns]
  tf = _apply(variables, VQVAE.indices_to_var_input, idx)
  assert tf.shape == (B, sum(p * p for p in pns) - 1, cz)
  f_hat, nexts = jnp.zeros((B, 4, 4, cz)), []
  for si, pn in enumerate(pns):
    h = _apply(variables, VQVAE.embed, idx[si]).reshape(B, pn, pn, cz)
    f_hat, nxt = _apply(variables, VQVAE.next_ar_input, si, f_hat, h)
    nexts.append(nxt.reshape(B, -1, cz))
  np.testing.assert_allclose(jnp.concatenate(nexts[:-1], axis=1), tf, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(nexts[-1], f_hat.reshape(B, -1, cz))
  np.testing.assert_allclose(f_hat, _apply(variables, VQVAE.indices_to_fhat, idx), rtol=1e-6, atol=1e-6)


def test_training_forward_loss_and_straight_through():
  cfg = dataclasses.replace(CFG, ch_mult=(1,), num_res_blocks=0, using_sa=False, using_mid_sa=False)
  params = convert_vqvae(official_state_dict(cfg), cfg)
  img = jnp.asarray(np.random.default_rng(7).uniform(-1, 1, size=(B, 4, 4, 3)), jnp.float32)
  model = VQVAE(cfg)
  fwd = lambda p: model.apply({'params': p}, img)

  @jax.jit
  def run(p):
    f = model.apply({'params': p}, img, method=VQVAE.encode)
    f_hats = model.apply({'params': p}, f, method=VQVAE.f_to_fhats)
    grads = jax.grad(lambda q: jnp.sum(fwd(q)[0]))(p), jax.grad(lambda q: fwd(q)[1])(p)
    return f, f_hats, fwd(p), grads

  f, f_hats, (rec, loss), (g_rec, g_loss) = run(params)
  want = (1 + cfg.beta) * np.mean([np.mean((np.asarray(h) - np.asarray(f)) ** 2) for h in f_hats])
  assert rec.shape == img.shape
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  assert float(jnp.abs(g_rec['encoder']['conv_in']['kernel']).max()) > 0  # gradient passes the quantizer
  assert float(jnp.abs(g_rec['embedding']['embedding']).max()) == 0  # the decoder path does not train the codebook
  assert float(jnp.abs(g_loss['embedding']['embedding']).max()) > 0
  assert float(jnp.abs(g_loss['quant_resi_3']['conv']['kernel']).max()) > 0
