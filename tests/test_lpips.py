"""LPIPS (vgg, v0.1): a distance (zero on identical images, positive otherwise), its converter from
torchvision's vgg16 + the lpips package's lin layout, the CLI, and the checkpoint the VQVAE task loads."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from state_dict_edits import edit as edit_state_dict

from configs import var as var_configs
from train.tasks import make_task
from var_models import checkpoint
from var_models.convert.__main__ import main as convert_main
from var_models.convert.lpips import convert_lpips, vgg16_convs
from var_models.tokenizers.lpips import LPIPS, TAP_CHANNELS, VGG16Features

# The conv layers' positions in torchvision's vgg16().features (ReLUs and max pools between them).
TORCHVISION_VGG16_CONVS = (0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28)


def torch_layout_state_dicts(seed: int = 0) -> tuple[dict, dict]:
  """(torchvision vgg16 state dict with its classifier, lpips v0.1 lin state dict), random, NumPy."""
  rng = np.random.default_rng(seed)
  vgg, c_in = {}, 3
  for n, c_out in zip(TORCHVISION_VGG16_CONVS, (64,) * 2 + (128,) * 2 + (256,) * 3 + (512,) * 6):
    vgg[f'features.{n}.weight'] = (rng.standard_normal((c_out, c_in, 3, 3)) * np.sqrt(2 / (9 * c_in))).astype(np.float32)
    vgg[f'features.{n}.bias'] = (0.1 * rng.standard_normal(c_out)).astype(np.float32)
    c_in = c_out
  vgg['classifier.6.weight'] = np.zeros((10, 4), np.float32)
  lin = {f'lin{k}.model.1.weight': np.abs(rng.standard_normal((1, c, 1, 1))).astype(np.float32) / c
         for k, c in enumerate(TAP_CHANNELS)}
  return vgg, lin


@pytest.fixture(scope='module')
def state_dicts():
  return torch_layout_state_dicts()


@pytest.fixture(scope='module')
def params(state_dicts):
  return convert_lpips(*state_dicts)


@pytest.fixture(scope='module')
def distance():
  return jax.jit(lambda p, x, y: LPIPS().apply({'params': p}, x, y))


def _images(seed: int, shape=(2, 16, 16, 3)) -> np.ndarray:
  return np.random.default_rng(seed).uniform(-1, 1, shape).astype(np.float32)


def test_distance_is_zero_on_identical_images_and_positive_on_different_ones(params, distance):
  x, y = _images(0), _images(1)
  same = np.asarray(distance(params, x, x))
  other = np.asarray(distance(params, x, y))
  assert same.shape == other.shape == (2,) and same.dtype == np.float32
  np.testing.assert_allclose(same, 0.0, atol=1e-7)
  assert np.all(other > 1e-3)
  np.testing.assert_allclose(distance(params, y, x), other, rtol=1e-5)  # symmetric


def test_converter_maps_torchvision_conv_positions(state_dicts, params):
  assert [n for _, n, _, _ in vgg16_convs()] == list(TORCHVISION_VGG16_CONVS)
  vgg, lin = state_dicts
  np.testing.assert_array_equal(params['lin3']['kernel'], lin['lin3.model.1.weight'].transpose(2, 3, 1, 0))
  np.testing.assert_array_equal(params['vgg']['conv5_3']['bias'], vgg['features.28.bias'])


def test_first_conv_equals_lax_conv_with_the_torch_oihw_weight(state_dicts, params):
  vgg, _ = state_dicts
  x = _images(2, (1, 16, 16, 3))
  _, inter = VGG16Features().apply({'params': params['vgg']}, x, capture_intermediates=True, mutable=['intermediates'])
  ours = np.asarray(inter['intermediates']['conv1_1']['__call__'][0])
  want = jax.lax.conv_general_dilated(x.transpose(0, 3, 1, 2), vgg['features.0.weight'], (1, 1), ((1, 1), (1, 1)),
                                      dimension_numbers=('NCHW', 'OIHW', 'NCHW'),
                                      precision=jax.lax.Precision.HIGHEST)
  want = np.asarray(want).transpose(0, 2, 3, 1) + vgg['features.0.bias']
  np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('which, how, key, message', [
    (0, 'drop', 'features.28.bias', "the VGG16 state dict: checkpoint is missing key 'features.28.bias'"),
    (0, 'reshape', 'features.5.weight', "the VGG16 state dict: checkpoint key 'features.5.weight' has shape"),
    (0, 'extra', 'features.30.weight', "the VGG16 state dict: checkpoint has 1 unexpected key"),
    (1, 'drop', 'lin4.model.1.weight', "the LPIPS lin state dict: checkpoint is missing key 'lin4.model.1.weight'"),
    (1, 'reshape', 'lin2.model.1.weight', "the LPIPS lin state dict: checkpoint key 'lin2.model.1.weight' has shape"),
])
def test_bad_state_dicts_name_the_file_and_the_key(state_dicts, which, how, key, message):
  sds = list(state_dicts)
  sds[which] = edit_state_dict(sds[which], how, key)
  with pytest.raises(ValueError, match=re.escape(message)):
    convert_lpips(*sds)


def test_too_small_or_mismatched_images_are_clear_errors(params):
  with pytest.raises(ValueError, match='at least 16 x 16 px'):
    LPIPS().apply({'params': params}, _images(0, (1, 8, 8, 3)), _images(1, (1, 8, 8, 3)))
  with pytest.raises(ValueError, match='two images'):
    LPIPS().apply({'params': params}, _images(0), _images(1, (2, 32, 32, 3)))


def test_cli_writes_the_checkpoint_the_vqvae_task_loads(tmp_path, state_dicts, params):
  vgg, lin = state_dicts
  np.savez(tmp_path / 'vgg16.npz', **vgg)
  np.savez(tmp_path / 'vgg.npz', **lin)
  out = str(tmp_path / 'lpips')
  convert_main(['lpips', '--vgg', str(tmp_path / 'vgg16.npz'), '--lin', str(tmp_path / 'vgg.npz'), '--out', out])
  assert checkpoint.load_meta(out)['model'] == 'lpips-vgg-v0.1'
  config = var_configs.get_config('vqvae_tiny')
  config.loss.perceptual_weight = 1.0
  config.lpips_ckpt = out
  jax.tree.map(np.testing.assert_array_equal, make_task(config).frozen, params)
