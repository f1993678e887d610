"""MAR's sampler: the official schedule, equal to an MAE-dropping reference loop, checked input."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import mar as mar_configs
from sampling import sampling_from_config
from train.tasks import random_stand_in
from var_models.mar import model as mar_lib
from var_models.mar.diffloss import diffloss_sample
from var_models.mar.gaussian_diffusion import create_diffusion
from var_models.mar.model import MAR, diffloss_net, keep_indices
from var_models.mar.sampler import make_mar_sampler
from var_models.mar.schedule import mask_schedule
from var_models.tokenizers.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig

MAR_CFG = mar_lib.tiny()
VAE_CFG = AutoencoderKLConfig(embed_dim=4, z_channels=4, ch=32, ch_mult=(1, 2, 2, 2), num_res_blocks=1)
LABELS = np.array([1, 7], np.int32)


SMALL_CFG = mar_lib.tiny(img_size=16)  # 2 x 2 tokens: the step-by-step reference stays quick


def _params(cfg):
  """MAR's and the VAE's parameters: `random_stand_in`'s draw (NumPy, no initialiser compiled: the
  compile alone took ~25 s), every leaf then moved by 0.05 N(0, 1) (the official init zeroes the
  head's output layers; here each term matters)."""
  def init(key):
    img = jnp.zeros((1, cfg.img_size, cfg.img_size, 3))
    return {'mar': mar_lib.init_params(cfg, key),
            'vae': AutoencoderKL(VAE_CFG).init(key, img, jax.random.key(2))['params']}
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda p: jnp.asarray(p + 0.05 * rng.standard_normal(p.shape, np.float32)),
                      random_stand_in(jax.eval_shape(init, jax.random.key(0)), seed=0))


@pytest.fixture(scope='module')
def params():
  return _params(MAR_CFG)


def _official_counts(seq_len, num_iter):
  """The official loop's (masked, mask_len, predicted) per step, transcribed."""
  masked, out = seq_len, []
  for step in range(num_iter):
    mask_len = np.floor(seq_len * np.cos(math.pi / 2. * (step + 1) / num_iter))
    mask_len = max(1, min(masked - 1, mask_len))
    pred = masked if step >= num_iter - 1 else masked - mask_len
    out.append((masked, mask_len, pred))
    masked -= pred
  return out


@pytest.mark.parametrize('seq_len,num_iter', [(256, 64), (256, 256), (256, 1), (16, 5), (320, 7)])
def test_mask_schedule_matches_the_official_loop(seq_len, num_iter):
  s = mask_schedule(seq_len, num_iter)
  assert list(zip(s.masked, s.mask_len, s.n_pred)) == _official_counts(seq_len, num_iter)
  assert s.n_pred.sum() == seq_len and (s.n_pred >= 1).all()


def test_num_iter_equal_to_token_count_predicts_one_token_per_step():
  assert (mask_schedule(16, 16).n_pred == 1).all()


def _reference_sample(mc, params, key, labels, cfg, temperature):
  """The official algorithm step by step with MAE dropping (keep_idx), for num_iter = N."""
  mp = {'params': params['mar']}
  model, n, b = MAR(mc), mc.seq_len, labels.shape[0]
  key, k_order = jax.random.split(key)
  order = np.asarray(jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(k_order, b)))
  class_emb = jnp.concatenate([model.apply(mp, jnp.asarray(labels), method=MAR.class_embedding),
                               model.apply(mp, b, method=MAR.fake_class)])
  tokens = jnp.zeros((b, n, mc.token_embed_dim))
  s = mask_schedule(n, n)
  diffusion = create_diffusion(mc.num_sampling_steps)
  # Each piece compiled (eagerly, every op of the head's 100 steps would dispatch alone).
  forward = jax.jit(lambda t2, m2, keep: model.apply(
      mp, model.apply(mp, t2, m2, class_emb, keep, method=MAR.encode), m2, keep, method=MAR.decode))
  head = jax.jit(lambda z, k, g: diffloss_sample(diffloss_net(mc), params['mar']['diffloss'], z, k, temperature, g,
                                                 guided=True, diffusion=diffusion))
  for i in range(n):
    mask = np.zeros((b, n), bool)
    np.put_along_axis(mask, order[:, :s.masked[i]], True, axis=1)
    m2 = jnp.asarray(np.concatenate([mask, mask]))
    t2 = jnp.concatenate([tokens, tokens])
    keep = keep_indices(mc, m2, n - int(s.masked[i]))
    z = forward(t2, m2, keep)
    pos = order[:, s.mask_len[i]:s.masked[i]] if i < n - 1 else order[:, :s.masked[i]]
    pos2 = np.concatenate([pos, pos])
    z_sel = jnp.take_along_axis(z, jnp.asarray(pos2)[..., None], axis=1).reshape(-1, z.shape[-1])
    guidance = 1 + (cfg - 1) * (n - s.mask_len[i]) / n
    new = head(z_sel, jax.random.fold_in(key, i), guidance)[:b]
    tokens = tokens.at[np.arange(b)[:, None], pos].set(new.reshape(b, -1, mc.token_embed_dim))
  return tokens


def test_scan_sampler_equals_mae_dropping_reference():
  """Random heads predict huge x0 near t = T (tokens ~1e4), so compare relative to the scale."""
  params = _params(SMALL_CFG)
  sample = make_mar_sampler(SMALL_CFG, VAE_CFG, num_iter=SMALL_CFG.seq_len, guided=True)
  _, aux = sample(params, jax.random.key(4), LABELS, cfg=3.0, temperature=0.9)
  want = np.asarray(_reference_sample(SMALL_CFG, params, jax.random.key(4), LABELS, 3.0, 0.9))
  assert np.abs(np.asarray(aux['tokens']) - want).max() <= 1e-5 * np.abs(want).max()


def test_encoder_on_padded_known_positions_equals_every_position_with_keys_hidden(params):
  """The gathered encoder, its 5 iterations' lengths padded into 2, against every position with
  the unknown ones hidden as keys: the same tokens to float32 rounding (relative to their scale)."""
  make = lambda n: make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=5, guided=True, encoder_sizes=n)
  gathered, every = make(2), make(None)
  kept = [MAR_CFG.buffer_size + MAR_CFG.seq_len - int(m) for m in gathered.schedule.mask.masked]
  assert every.encoder_lengths == (None,) * 5 and make(5).encoder_lengths == tuple(kept)
  assert len(set(gathered.encoder_lengths)) == 2 and set(make(1).encoder_lengths) == {max(kept)}
  assert all(k <= l for k, l in zip(kept, gathered.encoder_lengths)) and max(gathered.encoder_lengths) == max(kept)
  want = np.asarray(every(params, jax.random.key(3), LABELS, cfg=2.0)[1]['tokens'])
  got = np.asarray(gathered(params, jax.random.key(3), LABELS, cfg=2.0)[1]['tokens'])
  assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_encoder_sizes_must_be_a_positive_int():
  with pytest.raises(ValueError, match='encoder_sizes must be None or an int >= 1, got 0'):
    make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=5, encoder_sizes=0)


def test_every_token_is_sampled_and_same_key_gives_same_images(params):
  sample = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=5, guided=True)
  a, aux = sample(params, jax.random.key(1), LABELS, cfg=2.0, cfg_schedule='constant')
  b, _ = sample(params, jax.random.key(1), LABELS, cfg=2.0, cfg_schedule='constant')
  c, _ = sample(params, jax.random.key(2), LABELS, cfg=2.0, cfg_schedule='constant')
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  assert (np.abs(np.asarray(aux['tokens'])).sum(-1) > 0).all()
  assert a.shape == (2, MAR_CFG.img_size, MAR_CFG.img_size, 3) and 0 <= float(a.min()) <= float(a.max()) <= 1


def test_unguided_sampler_runs_single_batch(params):
  sample = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=3, guided=False)
  images, aux = sample(params, jax.random.key(0), LABELS)
  assert images.shape[0] == 2 and aux['tokens'].shape == (2, MAR_CFG.seq_len, MAR_CFG.token_embed_dim)


@pytest.mark.parametrize('kwargs,message', [
    (dict(cfg=0.5), 'cfg must be >= 1'),
    (dict(temperature=0.0), 'temperature must be > 0'),
    (dict(cfg_schedule='cosine'), "unknown cfg_schedule 'cosine'"),
    (dict(labels=np.array([3, 10])), 'labels must be in'),
])
def test_bad_sampling_arguments_raise_before_compiling(params, kwargs, message):
  sample = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=2, guided=True)
  args = dict(labels=LABELS, cfg=3.0) | kwargs
  with pytest.raises(ValueError, match=message):
    sample(params, jax.random.key(0), args.pop('labels'), **args)
  assert sample._jitted._cache_size() == 0


@pytest.mark.parametrize('num_iter', [0, MAR_CFG.seq_len + 1])
def test_num_iter_outside_token_count_is_rejected(num_iter):
  with pytest.raises(ValueError, match='num_iter must be in'):
    make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=num_iter)


def test_the_config_and_its_override_choose_the_encoder_lengths():
  config = mar_configs.get_config('tiny')
  assert sampling_from_config(config).settings['encoder_sizes'] == 4
  assert sampling_from_config(config, {'encoder_sizes': 2}).settings['encoder_sizes'] == 2
  assert sampling_from_config(config, {'encoder_sizes': 0}).settings['encoder_sizes'] is None   # every position
