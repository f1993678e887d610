"""configs/ecar.py: every variant builds, the paper's parameter totals (shapes only), errors naming the key."""
import jax
import pytest

from configs import ecar as ecar_configs
from ecar import ecar_config, param_count
from ecar.model import abstract_params

# Paper (Table 2) and ours, counted with jax.eval_shape (AR + the three denoisers; the VAE is apart).
PAPER = {'S': 155e6, 'B': 511e6, 'L': 854e6}
OURS = {'S': 145_189_644, 'B': 495_801_356, 'L': 833_977_740}


def _cpu(variant):
  c = ecar_configs.get_config(variant)
  c.attn_backend = 'xla'
  return c


@pytest.mark.parametrize('variant,sizes', [('S', (10, 768, 6)), ('B', (20, 1024, 16)), ('L', (24, 1152, 16))])
def test_table_1_sizes_and_param_totals_within_ten_percent(variant, sizes):
  cfg = ecar_config(_cpu(variant))
  assert (cfg.ar_depth, cfg.ar_width, cfg.ar_heads) == sizes
  total = param_count(abstract_params(cfg))
  assert total == OURS[variant]
  assert abs(total / PAPER[variant] - 1) < 0.10
  assert cfg.stage_sizes == (8, 16, 32) and cfg.stage_tokens == (64, 256, 1024) and cfg.data_channels == 4
  assert cfg.vae.scaling_factor == 0.13025 and cfg.vae.downsample == 8 and cfg.latent_space == 'vae'


def test_no_ar_ablation_moves_the_layers_into_the_denoisers():
  base, ablation = ecar_config(_cpu('S')), ecar_config(_cpu('S_no_ar'))
  assert ablation.ar_depth == 0 and ablation.den_depth == base.den_depth + round(base.ar_depth / 3)
  params = abstract_params(ablation)
  assert not any(k.startswith('blocks_') for k in params['ar'])
  assert len([k for k in params['denoiser_0'] if k.startswith('blocks_')]) == ablation.den_depth


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
