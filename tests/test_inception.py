"""FID's Inception-v3: pytorch-fid's input path (bilinear resize, [-1, 1]), eval-mode BatchNorm, the FID
pools, the three outputs, the converter from pytorch-fid's torch layout, the CLI and loader, and (with
torch and pytorch-fid installed) parity with pytorch-fid itself."""
from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
import pytest
from state_dict_edits import edit as edit_state_dict

from var_models import checkpoint
from var_models.convert.__main__ import main as convert_main
from var_models.convert.inception import convert_inception, load_inception
from var_models.tokenizers.inception import ConvBN, FIDInceptionV3, pool_3x3, preprocess

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / 'benchmarks'


def torchvision_convs() -> list[tuple[str, int, int, tuple[int, int]]]:
  """(prefix, c_in, c_out, (kh, kw)) of each BasicConv2d of torchvision's Inception3, restated from its source."""
  layers = [('Conv2d_1a_3x3', 3, 32, (3, 3)), ('Conv2d_2a_3x3', 32, 32, (3, 3)), ('Conv2d_2b_3x3', 32, 64, (3, 3)),
            ('Conv2d_3b_1x1', 64, 80, (1, 1)), ('Conv2d_4a_3x3', 80, 192, (3, 3))]
  for b, c, pool in (('Mixed_5b', 192, 32), ('Mixed_5c', 256, 64), ('Mixed_5d', 288, 64)):
    layers += [(f'{b}.branch1x1', c, 64, (1, 1)), (f'{b}.branch5x5_1', c, 48, (1, 1)),
               (f'{b}.branch5x5_2', 48, 64, (5, 5)), (f'{b}.branch3x3dbl_1', c, 64, (1, 1)),
               (f'{b}.branch3x3dbl_2', 64, 96, (3, 3)), (f'{b}.branch3x3dbl_3', 96, 96, (3, 3)),
               (f'{b}.branch_pool', c, pool, (1, 1))]
  layers += [('Mixed_6a.branch3x3', 288, 384, (3, 3)), ('Mixed_6a.branch3x3dbl_1', 288, 64, (1, 1)),
             ('Mixed_6a.branch3x3dbl_2', 64, 96, (3, 3)), ('Mixed_6a.branch3x3dbl_3', 96, 96, (3, 3))]
  for b, c7 in (('Mixed_6b', 128), ('Mixed_6c', 160), ('Mixed_6d', 160), ('Mixed_6e', 192)):
    layers += [(f'{b}.branch1x1', 768, 192, (1, 1)), (f'{b}.branch7x7_1', 768, c7, (1, 1)),
               (f'{b}.branch7x7_2', c7, c7, (1, 7)), (f'{b}.branch7x7_3', c7, 192, (7, 1)),
               (f'{b}.branch7x7dbl_1', 768, c7, (1, 1)), (f'{b}.branch7x7dbl_2', c7, c7, (7, 1)),
               (f'{b}.branch7x7dbl_3', c7, c7, (1, 7)), (f'{b}.branch7x7dbl_4', c7, c7, (7, 1)),
               (f'{b}.branch7x7dbl_5', c7, 192, (1, 7)), (f'{b}.branch_pool', 768, 192, (1, 1))]
  layers += [('Mixed_7a.branch3x3_1', 768, 192, (1, 1)), ('Mixed_7a.branch3x3_2', 192, 320, (3, 3)),
             ('Mixed_7a.branch7x7x3_1', 768, 192, (1, 1)), ('Mixed_7a.branch7x7x3_2', 192, 192, (1, 7)),
             ('Mixed_7a.branch7x7x3_3', 192, 192, (7, 1)), ('Mixed_7a.branch7x7x3_4', 192, 192, (3, 3))]
  for b, c in (('Mixed_7b', 1280), ('Mixed_7c', 2048)):
    layers += [(f'{b}.branch1x1', c, 320, (1, 1)), (f'{b}.branch3x3_1', c, 384, (1, 1)),
               (f'{b}.branch3x3_2a', 384, 384, (1, 3)), (f'{b}.branch3x3_2b', 384, 384, (3, 1)),
               (f'{b}.branch3x3dbl_1', c, 448, (1, 1)), (f'{b}.branch3x3dbl_2', 448, 384, (3, 3)),
               (f'{b}.branch3x3dbl_3a', 384, 384, (1, 3)), (f'{b}.branch3x3dbl_3b', 384, 384, (3, 1)),
               (f'{b}.branch_pool', c, 192, (1, 1))]
  return layers


def torch_layout_state_dict(seed: int = 0) -> dict:
  """A random state dict as a torch module saves pytorch-fid's network (num_batches_tracked included), NumPy."""
  rng = np.random.default_rng(seed)
  normal = lambda shape, std: (std * rng.standard_normal(shape)).astype(np.float32)
  sd = {}
  for prefix, c_in, c_out, (kh, kw) in torchvision_convs():
    sd[f'{prefix}.conv.weight'] = normal((c_out, c_in, kh, kw), np.sqrt(2 / (c_in * kh * kw)))
    sd[f'{prefix}.bn.weight'] = 1 + normal(c_out, 0.1)
    sd[f'{prefix}.bn.bias'] = normal(c_out, 0.1)
    sd[f'{prefix}.bn.running_mean'] = normal(c_out, 0.1)
    sd[f'{prefix}.bn.running_var'] = rng.uniform(0.5, 1.5, c_out).astype(np.float32)
    sd[f'{prefix}.bn.num_batches_tracked'] = np.array(0, np.int64)
  sd['fc.weight'] = normal((1008, 2048), np.sqrt(1 / 2048))
  sd['fc.bias'] = normal(1008, 0.1)
  return sd


@pytest.fixture(scope='module')
def state_dict():
  return torch_layout_state_dict()


@pytest.fixture(scope='module')
def params(state_dict):
  return convert_inception(state_dict)


@pytest.fixture(scope='module')
def features(params):
  """(outputs, Mixed_6d.branch1x1's output [2, 17, 17, 192]) for two 48 x 40 images."""
  images = np.random.default_rng(1).uniform(0, 1, (2, 48, 40, 3)).astype(np.float32)
  is_tap = lambda module, _: module.scope.path == ('Mixed_6d', 'branch1x1')
  run = jax.jit(lambda p, x: FIDInceptionV3().apply({'params': p}, x, capture_intermediates=is_tap,
                                                    mutable=['intermediates']))
  out, state = run(params, images)
  return out, state['intermediates']['Mixed_6d']['branch1x1']['__call__'][0]


def test_outputs_pool_bias_free_logits_and_adm_spatial_features(params, features):
  out, branch1x1 = features
  assert {k: v.shape for k, v in out.items()} == {'pool': (2, 2048), 'logits': (2, 1008), 'spatial': (2, 2023)}
  assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in out.values())
  np.testing.assert_allclose(out['logits'], np.asarray(out['pool']) @ params['fc']['kernel'], rtol=1e-5, atol=1e-5)
  assert branch1x1.shape == (2, 17, 17, 192)
  np.testing.assert_array_equal(out['spatial'], np.asarray(branch1x1)[..., :7].reshape(2, -1))
  assert np.all(np.asarray(out['spatial']) >= 0) and np.all(np.asarray(out['pool']) >= 0)  # after ReLUs


def test_non_rgb_input_is_a_clear_error(params):
  with pytest.raises(ValueError, match=re.escape('RGB images [B, H, W, 3]')):
    FIDInceptionV3().apply({'params': params}, np.zeros((2, 32, 32, 1), np.float32))


def _bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
  """[n_out, n_in]: F.interpolate(mode='bilinear', align_corners=False) along one axis. The source
  coordinate is rounded to float32 once, as PyTorch's fused multiply-add does (exact float64
  coordinates would move a 512 px input's pixels by up to 3e-5)."""
  scale = np.float64(np.float32(n_in) / np.float32(n_out))
  src = np.maximum(scale * (np.arange(n_out) + 0.5) - 0.5, 0).astype(np.float32)
  i0 = np.floor(src).astype(int)
  i1 = np.minimum(i0 + 1, n_in - 1)
  frac = np.float64(src) - i0
  m = np.zeros((n_out, n_in))
  np.add.at(m, (np.arange(n_out), i0), 1 - frac)
  np.add.at(m, (np.arange(n_out), i1), frac)
  return m


@pytest.mark.parametrize('hw', [(64, 64), (512, 512), (40, 300), (299, 299)])
def test_preprocess_is_pytorch_bilinear_then_2x_minus_1(hw):
  x = np.random.default_rng(2).uniform(0, 1, (2, *hw, 3)).astype(np.float32)
  rows, cols = _bilinear_matrix(hw[0], 299), _bilinear_matrix(hw[1], 299)
  want = np.einsum('oh,bhwc,pw->bopc', rows, x.astype(np.float64), cols, optimize=True)
  np.testing.assert_allclose(preprocess(x), 2 * want - 1, atol=1e-6)


def test_branch_pools_are_tensorflows():
  x = np.full((1, 5, 6, 2), 3.0, np.float32)
  np.testing.assert_allclose(pool_3x3(x, 'avg'), x)  # padding counts for nothing, corners included
  y = -np.random.default_rng(3).uniform(1, 2, (1, 5, 6, 2)).astype(np.float32)
  np.testing.assert_array_equal(pool_3x3(y, 'max')[0, 0, 0], y[0, :2, :2].max(axis=(0, 1)))  # never the padding


def test_conv_bn_is_batchnorm_in_eval_mode():
  rng = np.random.default_rng(4)
  x = rng.standard_normal((3, 5, 5, 4)).astype(np.float32)
  kernel = rng.standard_normal((4, 6)).astype(np.float32)
  scale, bias, mean = (rng.standard_normal(6).astype(np.float32) for _ in range(3))
  var = rng.uniform(0.5, 1.5, 6).astype(np.float32)
  p = {'conv': {'kernel': kernel[None, None]}, 'bn': {'scale': scale, 'bias': bias, 'mean': mean, 'var': var}}
  got = np.asarray(ConvBN(6, (1, 1)).apply({'params': p}, x))
  want = np.maximum((x @ kernel - mean) / np.sqrt(var + 1e-3) * scale + bias, 0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ConvBN(6, (1, 1)).apply({'params': p}, x[:1]), got[:1])  # no batch statistics


def test_converter_maps_every_torch_key_to_its_module(state_dict, params):
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  assert len(flat) == 5 * len(torchvision_convs()) + 1 == 471
  layer, torch_prefix = params['Mixed_6d']['branch7x7dbl_2'], 'Mixed_6d.branch7x7dbl_2'
  assert layer['conv']['kernel'].shape == (7, 1, 160, 160)  # HWIO: the 7x1 of the torch (160, 160, 7, 1)
  np.testing.assert_array_equal(layer['conv']['kernel'], state_dict[f'{torch_prefix}.conv.weight'].transpose(2, 3, 1, 0))
  for ours, torch_name in (('scale', 'weight'), ('bias', 'bias'), ('mean', 'running_mean'), ('var', 'running_var')):
    np.testing.assert_array_equal(layer['bn'][ours], state_dict[f'{torch_prefix}.bn.{torch_name}'])
  np.testing.assert_array_equal(params['fc']['kernel'], state_dict['fc.weight'].T)


@pytest.mark.parametrize('how, key, message', [
    ('drop', 'Mixed_7c.branch_pool.bn.running_var', "missing key 'Mixed_7c.branch_pool.bn.running_var'"),
    ('reshape', 'Mixed_6b.branch7x7_2.conv.weight', "key 'Mixed_6b.branch7x7_2.conv.weight' has shape (127, 128, 1, 7)"),
    ('reshape', 'fc.weight', "key 'fc.weight' has shape (1007, 2048), expected (1008, 2048)"),
    ('extra', 'AuxLogits.conv0.conv.weight', "1 unexpected key(s): 'AuxLogits.conv0.conv.weight'"),
])
def test_bad_state_dicts_name_the_key(state_dict, how, key, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    convert_inception(edit_state_dict(state_dict, how, key))


def test_cli_writes_what_load_inception_reads(tmp_path, state_dict, params):
  np.savez(tmp_path / 'pt_inception.npz', **state_dict)
  out = str(tmp_path / 'inception')
  convert_main(['inception', '--pth', str(tmp_path / 'pt_inception.npz'), '--out', out])
  assert checkpoint.load_meta(out)['model'] == 'fid-inception-v3-2015-12-05'
  model, loaded = load_inception(out)
  assert isinstance(model, FIDInceptionV3)
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_matches_pytorch_fid(monkeypatch):
  pytest.importorskip('torch')
  pytest.importorskip('pytorch_fid')
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  import parity_inception  # pylint: disable=import-outside-toplevel
  network, wrapper = parity_inception.build_official(seed=0)
  ours = convert_inception({k: v.numpy() for k, v in network.state_dict().items()})
  images = np.random.default_rng(5).uniform(0, 1, (2, 64, 64, 3)).astype(np.float32)
  want = parity_inception.official_features(network, wrapper, images)
  got = jax.jit(lambda p, x: FIDInceptionV3().apply({'params': p}, x))(ours, images)
  for key, official in want.items():
    err = np.abs(np.asarray(got[key], np.float64) - official).max() / np.abs(official).max()
    assert err < 1e-4, (key, err)
