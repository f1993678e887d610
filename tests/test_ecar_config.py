"""configs/ecar.py: every variant builds, Table 2's parameters and FLOPs (shapes only), errors naming the key."""
import jax
import pytest

from configs import ecar as ecar_configs
from ecar import ecar_config, param_count, sampling_flops
from ecar.config import ECARConfig
from ecar.model import abstract_params

# Table 2 of the paper, and ours: parameters counted with jax.eval_shape (AR + the three
# denoisers; the VAE apart), sampling FLOPs with CFG and 250 steps on the sampler's jaxpr without
# the VAE decoder (ecar.sampling_flops; the convention MAR calibrates, see configs/ecar.py).
PAPER = {'S': (155e6, 1.0e12), 'B': (511e6, 3.2e12), 'L': (854e6, 5.8e12)}
OURS_PARAMS = {'S': 154_205_376, 'B': 512_540_864, 'L': 855_463_872}


def _cpu(variant):
  c = ecar_configs.get_config(variant)
  c.attn_backend = 'xla'
  return c


@pytest.mark.parametrize('variant,sizes', [('S', (10, 768, 6)), ('B', (20, 1024, 16)), ('L', (24, 1152, 16))])
def test_presets_match_table_1_and_table_2(variant, sizes):
  cfg = ecar_config(_cpu(variant))
  assert (cfg.ar_depth, cfg.ar_width, cfg.ar_heads) == sizes
  assert cfg.stage_sizes == (8, 16, 32) and cfg.stage_tokens == (4, 16, 64) and cfg.data_channels == 4
  assert cfg.vae.scaling_factor == 0.13025 and cfg.vae.downsample == 8 and cfg.latent_space == 'vae'
  params, flops = PAPER[variant]
  total = param_count(abstract_params(cfg))
  assert total == OURS_PARAMS[variant]
  assert abs(total / params - 1) < 0.03
  counted = sampling_flops(cfg, num_steps=250)['per_image_without_decode']
  assert abs(counted / flops - 1) < 0.15, counted


def test_patch1_ablation_is_the_costlier_model():
  cfg = ecar_config(_cpu('S_patch1'))
  assert cfg.patch_size == 1 and cfg.den_depths == (2, 2, 2) and cfg.stage_tokens == (64, 256, 1024)
  assert param_count(abstract_params(cfg)) == 145_189_644


@pytest.mark.parametrize('size', ['S', 'B', 'L'])
def test_no_ar_ablation_moves_the_layers_into_the_denoisers(size):
  base, ablation = ecar_config(_cpu(size)), ecar_config(_cpu(f'{size}_no_ar'))
  extra = round(base.ar_depth / 3)
  assert ablation.ar_depth == 0 and ablation.den_depths == tuple(d + extra for d in base.den_depths)
  params = abstract_params(ablation)
  assert not any(k.startswith('blocks_') for k in params['ar'])
  for s, depth in enumerate(ablation.den_depths):
    assert len([k for k in params[f'denoiser_{s}'] if k.startswith('blocks_')]) == depth


def test_ecar_config_defaults_are_e_car_s():
  assert ECARConfig(attn_backend='xla') == ecar_config(_cpu('S'))


def test_tiny_is_pixel_space_and_small():
  c = ecar_configs.get_config('tiny')
  cfg = ecar_config(c)
  assert c.family == 'ecar' and cfg.latent_space == 'pixel' and cfg.stage_sizes == (8, 16, 32)
  assert param_count(abstract_params(cfg)) < 5_000_000
  assert ecar_config(ecar_configs.get_config('tiny_no_ar')).ar_depth == 0


@pytest.mark.parametrize('key,value,match', [
    ('model.ar_heads', 5, 'config.model.ar_heads: 5 does not divide ar_width 128'),
    ('model.num_stages', 6, 'config.model.num_stages'),
    ('model.cond_drop_rate', 1.0, r'config.model.cond_drop_rate: must be in \[0, 1\)'),
    ('flow.gamma', -0.1, 'config.flow.gamma'),
    ('flow.gamma', 0.5, r'config.flow.gamma: must be in \(0, 1/3\]'),
    ('model.den_depth', 0, r'config.model.den_depth: must be a positive int or 3 of them'),
    ('flow.time_windows', 'linear', 'config.flow.time_windows'),
    ('gradnorm.layer', 'denoiser_0/norm', 'config.gradnorm.layer'),
    ('gradnorm.layer', 'ar/no_such_layer', "config.gradnorm.layer: gradnorm layer 'ar/no_such_layer'"),
    ('latent_space', 'rgb', 'config.latent_space'),
    ('image_size', 30, 'config.model.num_stages'),
    ('dtype', 'int8', 'config.dtype'),
])
def test_bad_value_names_the_config_key(key, value, match):
  c = ecar_configs.get_config('tiny')
  section, _, name = key.rpartition('.')
  (c[section] if section else c)[name] = value
  with pytest.raises(ValueError, match=match):
    ecar_config(c)


def test_cudnn_on_cpu_is_a_config_error():
  if jax.default_backend() == 'gpu':
    pytest.skip('cudnn is available here')
  with pytest.raises(ValueError, match="config.attn_backend='cudnn' needs an NVIDIA GPU"):
    ecar_config(ecar_configs.get_config('S'))


def test_unknown_variant():
  with pytest.raises(ValueError, match="unknown E-CAR variant 'XL'"):
    ecar_configs.get_config('XL')
