"""The VQVAE task's perceptual and adversarial terms: the PatchGAN, its batch-statistics normalisation,
the hinge losses, gradient routing through one optimizer step, the disc_start gate, the export,
and the config checks."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import var as var_configs
from train.tasks import make_task, random_stand_in
from var_models import checkpoint
from var_models.tokenizers.lpips import LPIPS
from var_models.tokenizers.patch_discriminator import (BatchStatNorm, PatchDiscriminator, discriminator_hinge_loss,
                                            generator_loss, patch_grid)
from var_models.tokenizers.vqvae import VQVAE
from var_models.var import from_config as var_from_config

KEY = jax.random.key(2)
TERMS = ('base', 'generator', 'hinge')


def small_config(grad_accum: int = 1):
  """configs/var.py:vqvae_tiny at 16 px (the smallest LPIPS takes) with every term on."""
  c = var_configs.get_config('vqvae_tiny')
  c.image_size, c.patch_nums = 16, (1, 2, 4, 8)
  c.vqvae.update(ch=32, ch_mult=(1, 1), vocab_size=32, z_channels=4)
  c.loss.update(perceptual_weight=0.7, disc_weight=0.5, disc_start=3, disc_channels=8, disc_layers=2)
  c.train.grad_accum = grad_accum
  return c


def _params_and_inputs(task):
  """Random params shaped like task.init's (drawn without compiling the init) and one batch's inputs."""
  params = random_stand_in(jax.eval_shape(task.init, jax.random.key(0))[0], seed=0)
  images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
  return params, task.inputs(task.frozen, {'image': images}, jax.random.key(1))


@pytest.fixture(scope='module')
def setup():
  """(config, task, params, inputs, jitted value_and_grad of the task's loss at a given micro_steps)."""
  config = small_config()
  task = make_task(config)
  params, inputs = _params_and_inputs(task)
  grad_fn = jax.jit(lambda p, steps, x: jax.value_and_grad(task.loss, has_aux=True)(
      p, {'micro_steps': steps}, x, None, KEY))
  return config, task, params, inputs, grad_fn


@pytest.fixture(scope='module')
def reference(setup):
  """Each term of eq. 5 differentiated on its own, with no stop_gradient anywhere: {term: (value, grad wrt
  the VQVAE params, grad wrt the discriminator params)} for 'base' (mse + vq + w_p * lpips), 'generator'
  (-mean D(rec)) and 'hinge' (D's hinge loss on images and rec)."""
  config, _, params, (images, lpips_params), _ = setup
  q = config.loss
  vq, disc = VQVAE(var_from_config.vqvae_config(config)), PatchDiscriminator(q.disc_channels, q.disc_layers)
  logits = lambda d, x: disc.apply({'params': d}, x)

  def terms(both):
    vq_params, disc_params = both
    rec, vq_loss = vq.apply({'params': vq_params}, images, train=True, rngs={'dropout': KEY})
    perceptual = jnp.mean(LPIPS().apply({'params': lpips_params}, rec, images))
    return jnp.stack([jnp.mean(jnp.square(rec - images)) + vq_loss + q.perceptual_weight * perceptual,
                      generator_loss(logits(disc_params, rec)),
                      discriminator_hinge_loss(logits(disc_params, images), logits(disc_params, rec))])

  both = (params['vqvae'], params['disc'])
  values, (g_vq, g_disc) = jax.jit(lambda p: (terms(p), jax.jacrev(terms)(p)))(both)
  return {name: (values[i], jax.tree.map(lambda g: g[i], g_vq), jax.tree.map(lambda g: g[i], g_disc))
          for i, name in enumerate(TERMS)}


def _close(a, b) -> bool:
  """max |a - b| <= 1e-4 max |b| over whole trees (one program against another; per leaf would judge
  rounding noise on the biases before a GroupNorm, whose exact gradient is 0)."""
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
  return np.max(np.abs(flat(a) - flat(b))) <= 1e-4 * np.max(np.abs(flat(b)))


def _plus(a, b, scale=1.0):
  return jax.tree.map(lambda x, y: x + scale * y, a, b)


def test_discriminator_shape_and_vqgan_init():
  logits, variables = jax.jit(PatchDiscriminator(64, 3).init_with_output)(jax.random.key(0), jnp.zeros((2, 32, 32, 3)))
  assert logits.shape == (2, 2, 2) and logits.dtype == jnp.float32
  for size, layers in ((256, 3), (30, 1), (24, 3), (40, 2)):
    shape = jax.eval_shape(PatchDiscriminator(8, layers).init_with_output, jax.random.key(0),
                           jnp.zeros((1, size, size, 3)))[0].shape
    assert shape == (1, patch_grid(size, layers), patch_grid(size, layers))
  assert patch_grid(256, 3) == 30  # VQGAN's 30 x 30 patches at 256 px
  p = variables['params']
  assert set(p) == {'conv_0', 'conv_1', 'conv_2', 'conv_3', 'conv_4', 'norm_1', 'norm_2', 'norm_3'}
  assert 'bias' in p['conv_0'] and 'bias' in p['conv_4'] and 'bias' not in p['conv_1']  # normalised: no bias
  assert p['conv_3']['kernel'].shape == (4, 4, 256, 512)
  np.testing.assert_allclose(np.std(p['conv_3']['kernel']), 0.02, rtol=0.01)
  np.testing.assert_allclose(np.mean(p['norm_3']['scale']), 1.0, atol=0.005)
  np.testing.assert_allclose(np.std(p['norm_3']['scale']), 0.02, rtol=0.2)
  np.testing.assert_array_equal(p['norm_3']['bias'], 0.0)


def test_normalisation_uses_the_batch_statistics():
  x = np.random.default_rng(0).normal(2.0, 3.0, (4, 5, 5, 6)).astype(np.float32)
  norm = jax.jit(BatchStatNorm().apply)
  p = {'params': {'scale': jnp.ones(6), 'bias': jnp.zeros(6)}}
  y = np.asarray(norm(p, x))
  np.testing.assert_allclose(y.mean(axis=(0, 1, 2)), 0.0, atol=1e-5)
  np.testing.assert_allclose(y.var(axis=(0, 1, 2)), 1.0, rtol=1e-4)
  np.testing.assert_allclose(norm(p, 5.0 * x + 1.0), y, atol=1e-5)  # the batch's own scale and shift go
  # So one example's output depends on the batch it is normalised in.
  assert not np.allclose(norm(p, x[[0, 1]])[0], norm(p, x[[0, 2]])[0], atol=1e-3)


def test_hinge_losses():
  real, fake = jnp.array([2.0, 0.5]), jnp.array([-2.0, 0.5])
  # real: relu(1 - 2) = 0, relu(0.5) = 0.5; fake: relu(1 - 2) = 0, relu(1.5) = 1.5.
  np.testing.assert_allclose(discriminator_hinge_loss(real, fake), 0.5 * (0.25 + 0.75))
  np.testing.assert_allclose(generator_loss(fake), 0.75)


def test_one_gradient_trains_each_network_on_its_own_terms(setup, reference):
  config, _, params, inputs, grad_fn = setup
  (_, (metrics, state)), grads = grad_fn(params, jnp.int32(config.loss.disc_start), inputs)
  assert int(state['micro_steps']) == config.loss.disc_start + 1
  base, gen, hinge = (reference[t] for t in TERMS)
  w = config.loss.disc_weight
  # The discriminator's gradient is its hinge term's alone, none of the generator term's.
  assert _close(grads['disc'], hinge[2])
  assert not _close(grads['disc'], _plus(hinge[2], gen[2], w))
  # The VQVAE's gradient has the generator term and no part of the hinge term.
  assert _close(grads['vqvae'], _plus(base[1], gen[1], w))
  assert not _close(grads['vqvae'], _plus(_plus(base[1], gen[1], w), hinge[1]))
  np.testing.assert_allclose(metrics['loss/discriminator'], hinge[0], rtol=1e-5)
  np.testing.assert_allclose(metrics['loss/generator'], gen[0], rtol=1e-5)
  assert metrics['loss/perceptual'] > 0


def test_adversarial_terms_are_off_before_disc_start(setup, reference):
  config, _, params, inputs, grad_fn = setup
  (loss, (metrics, _)), grads = grad_fn(params, jnp.int32(config.loss.disc_start - 1), inputs)
  jax.tree.map(lambda g: np.testing.assert_array_equal(g, 0.0), grads['disc'])
  assert _close(grads['vqvae'], reference['base'][1])
  np.testing.assert_allclose(loss, reference['base'][0], rtol=1e-5)
  assert metrics['loss/discriminator'] > 0  # still measured


def test_gate_counts_optimizer_steps_under_gradient_accumulation():
  config = small_config(grad_accum=2)  # disc_start 3: micro-batches 6 and 7 make step 3
  config.loss.perceptual_weight = 0.0
  task = make_task(config)
  params, inputs = _params_and_inputs(task)
  loss = jax.jit(lambda steps: task.loss(params, {'micro_steps': steps}, inputs, None, KEY))
  (at0, (m, _)), at5, at6 = (loss(jnp.int32(s)) for s in (0, 5, 6))
  assert at5[0] == at0
  w = config.loss.disc_weight
  np.testing.assert_allclose(at6[0], at0 + w * m['loss/generator'] + m['loss/discriminator'], rtol=1e-6)


def test_init_and_export(setup):
  config, task, params, _, _ = setup
  trained, state = jax.eval_shape(task.init, jax.random.key(0))
  assert set(trained) == {'vqvae', 'disc'} and state['micro_steps'].shape == ()
  vq_abstract = jax.eval_shape(lambda k: VQVAE(var_from_config.vqvae_config(config)).init(
      k, jnp.zeros((1, 16, 16, 3)))['params'], jax.random.key(0))
  checkpoint.check_tree(vq_abstract, task.export(trained), 'the export')
  assert task.export(params) is params['vqvae'] and task.names == ('vqvae', None)


def test_without_the_perceptual_term_no_lpips_is_built():
  config = small_config()
  config.loss.perceptual_weight = 0.0
  config.lpips_ckpt = '/does/not/exist'  # never read
  assert make_task(config).frozen is None


@pytest.mark.parametrize('key, value, message', [
    ('perceptual_weight', -1.0, 'config.loss.perceptual_weight must be a number >= 0'),
    ('disc_weight', math.nan, 'config.loss.disc_weight must be a number >= 0'),
    ('disc_start', -1, 'config.loss.disc_start must be an integer >= 0'),
    ('disc_channels', 0, 'config.loss.disc_channels must be an integer >= 1'),
    ('disc_layers', 3, 'config.loss.disc_layers=3 leaves the discriminator no output for 16 px'),
])
def test_bad_loss_values_name_the_key(key, value, message):
  config = small_config()
  config.loss[key] = value
  with pytest.raises(ValueError, match=message):
    make_task(config)


def test_lpips_on_too_small_images_and_a_missing_loss_section_name_the_key():
  config = small_config()
  config.image_size, config.patch_nums = 8, (1, 2, 4)
  config.loss.disc_layers = 1
  with pytest.raises(ValueError, match='config.loss.perceptual_weight=0.7 needs images of at least 16 px'):
    make_task(config)
  del config['loss']
  with pytest.raises(ValueError, match='config has no `loss` section'):
    make_task(config)
