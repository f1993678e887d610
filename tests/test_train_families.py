"""A few steps of each family's tiny config through the whole training program."""
import os

import jax
import numpy as np
import pytest
from PIL import Image

from configs import ecar as ecar_configs
from configs import mar as mar_configs
from configs import var as var_configs
from train.data.sources import image_source
from train.tasks import make_task
from train.trainer import Trainer
from var_models import checkpoint as params_ckpt
from var_models.var import from_config as var_from_config


def small_var():
  """configs/var.py:tiny made smaller still: 8 px, 3 scales, a VQVAE of one downsampling."""
  c = var_configs.get_config('tiny')
  c.image_size, c.patch_nums = 8, (1, 2, 4)
  c.vqvae.update(ch=32, ch_mult=(1, 1), vocab_size=32, z_channels=4)
  c.model.update(depth=1, width=32)
  c.train.update(steps=3, batch_size=4, warmup_steps=1, log_every=1, sample_every=3, sample_classes=2,
                 sample_per_class=1, sample_metrics=0)
  c.data.update(num_examples=12, workers=0, threads=1)
  return c


def small_vqvae():
  """configs/var.py:vqvae_tiny with small_var's tokenizer and images, a one-layer discriminator
  (8 px images) that switches on after the first step."""
  c, var = var_configs.get_config('vqvae_tiny'), small_var()
  c.image_size, c.patch_nums = var.image_size, var.patch_nums
  c.vqvae.update(var.vqvae)
  c.loss.update(disc_layers=1, disc_channels=8, disc_start=1)
  c.train.update(steps=3, batch_size=4, warmup_steps=1, log_every=1, sample_every=3, sample_classes=2,
                 sample_per_class=1)
  c.data.update(num_examples=12, workers=0, threads=1)
  return c


def small_mar():
  """configs/mar.py:tiny made smaller still: 4 px, a VAE of one downsampling, 2 x 2 tokens."""
  c = mar_configs.get_config('tiny')
  c.model.update(img_size=4, vae_stride=2, encoder_depth=1, diffloss_d=1, diffloss_w=16, diffusion_batch_mul=1)
  c.vae.update(ch_mult=(1, 1))
  c.sample.update(num_iter=2, num_diffusion_steps=2)
  c.train.update(steps=2, batch_size=4, warmup_steps=1, log_every=1, sample_every=100, sample_classes=0)
  c.data.update(num_examples=12, workers=0, threads=1)
  return c


def test_var_tiny_trains_samples_and_exports_what_train_sample_loads(tmp_path):
  config = small_var()
  result = Trainer(config, str(tmp_path)).run()
  assert int(result.state.step) == 3 and np.isfinite(result.last_metrics['loss'])
  assert {'loss/scale_0', 'loss/scale_2', 'grad_norm', 'lr'} <= result.last_metrics.keys()
  grid = Image.open(tmp_path / 'samples' / 'step_0000003.png')
  assert grid.size[1] > 2 * 64   # one row per class, samples upscaled to >= 64 px
  assert any(f.startswith('events') for f in os.listdir(tmp_path / 'tensorboard'))
  assert params_ckpt.load_meta(str(tmp_path)) == {'family': 'var', 'step': 3, 'ema': True}
  exported = var_from_config.load_var_params(*var_from_config.var_configs(config), str(tmp_path))
  np.testing.assert_array_equal(exported['var']['pos_start'], result.state.ema_params['pos_start'])


def test_vqvae_trains_shows_reconstructions_and_exports_the_tokenizer_var_loads(tmp_path):
  config = small_vqvae()
  result = Trainer(config, str(tmp_path / 'vq')).run()
  assert int(result.state.step) == 3 and np.isfinite(result.last_metrics['loss'])
  assert {'loss/reconstruction', 'loss/vq', 'loss/perceptual', 'loss/generator', 'loss/discriminator',
          'disc/logits_real', 'disc/logits_fake'} <= result.last_metrics.keys()
  assert int(result.state.model_state['micro_steps']) == 3
  grid = Image.open(tmp_path / 'vq' / 'samples' / 'step_0000003.png')
  assert abs(grid.size[0] - grid.size[1]) <= 2  # 2 examples: rows of [original, reconstruction]
  assert params_ckpt.load_meta(str(tmp_path / 'vq')) == {'family': 'vqvae', 'step': 3, 'ema': True}
  params_ckpt.load_params(str(tmp_path / 'vq'), {'vqvae': result.state.ema_params['vqvae']})  # nothing else
  var = small_var()
  var.vqvae_ckpt = str(tmp_path / 'vq')
  jax.tree.map(np.testing.assert_array_equal, make_task(var).frozen, jax.device_get(result.state.ema_params['vqvae']))


def test_mar_tiny_trains_on_cached_latents_and_reuses_them(tmp_path):
  config = small_mar()
  config.data.update(cache_latents=True, workers=1)   # the cached latents reach a worker process by path
  trainer = Trainer(config, str(tmp_path))
  cache = tmp_path / 'latents' / 'synthetic-train-4px'
  stamp = os.path.getmtime(cache / 'moments-0.npy')
  # A cached example is the VAE posterior of the center crop; the flip picks the mirror's.
  image, label = image_source(config, 4, 10).load(5)
  flipped = [trainer.loader.example(5, np.random.default_rng(s)) for s in range(6)]
  direct = np.asarray(trainer.task.moments(trainer.task.frozen, np.stack([image, image[:, ::-1]])))
  for ex in flipped:
    assert ex['label'] == label
    assert any(np.allclose(ex['moments'], direct[f], atol=1e-5) for f in (0, 1))
  assert len({ex['moments'].tobytes() for ex in flipped}) == 2
  result = trainer.run()
  assert int(result.state.step) == 2 and np.isfinite(result.last_metrics['loss'])
  assert params_ckpt.load_meta(str(tmp_path))['family'] == 'mar'
  Trainer(config, str(tmp_path))
  assert os.path.getmtime(cache / 'moments-0.npy') == stamp


def test_mar_inputs_from_images_equal_inputs_from_their_moments():
  task = make_task(small_mar())
  images = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3), dtype=np.uint8)
  key = jax.random.key(3)
  from_images = task.inputs(task.frozen, {'image': images}, key)
  from_moments = task.inputs(task.frozen, {'moments': task.moments(task.frozen, images)}, key)
  np.testing.assert_allclose(from_images, from_moments, rtol=1e-6)


def small_ecar():
  """configs/ecar.py:tiny made smaller still: 8 px pixels, 2 stages (4 and 8 px), one layer each."""
  c = ecar_configs.get_config('tiny')
  c.image_size = 8
  c.model.update(num_stages=2, ar_depth=1, ar_width=32, ar_heads=2, den_depth=1, den_width=32, den_heads=2)
  c.train.update(steps=2, batch_size=4, warmup_steps=1, log_every=1, sample_every=100, sample_classes=0)
  c.data.update(num_examples=12, workers=0, threads=1)
  return c


def test_ecar_tiny_carries_gradnorm_through_its_steps(tmp_path):
  result = Trainer(small_ecar(), str(tmp_path)).run()
  assert int(result.state.step) == 2 and np.isfinite(result.last_metrics['loss'])
  assert {'loss/stage0', 'loss/stage1', 'gradnorm/w0', 'gradnorm/w1'} <= result.last_metrics.keys()
  gradnorm = result.state.model_state
  assert int(gradnorm.step) == 2   # updated once per step
  assert not np.allclose(gradnorm.initial_losses, 1.0)   # the first step's losses, carried on
  assert params_ckpt.load_meta(str(tmp_path))['family'] == 'ecar'


@pytest.mark.parametrize('build, key, value', [(small_var, 'top_p', 1.5), (small_mar, 'cfg_schedule', 'cosine'),
                                               (small_var, 'cfg', -1.0)])
def test_bad_sample_settings_fail_at_start_not_at_the_first_grid(tmp_path, build, key, value):
  config = build()
  config.sample[key] = value
  with pytest.raises(ValueError, match='bad config.sample'):
    Trainer(config, str(tmp_path))
  assert not os.path.exists(tmp_path / 'checkpoints')
