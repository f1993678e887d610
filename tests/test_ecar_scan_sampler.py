"""E-CAR's sampler with its blocks scanned (`scan_blocks=True`): the AR's stacked KV caches and the
denoisers' stacked blocks give the unrolled sampler's token maps and images, with one block per
run of alike blocks in the program."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ecar
from accel.ecar_caches import ECARConditionCache
from configs import ecar as ecar_configs
from sampling import sampling_from_config
from var_models.nn import blocks
from test_ecar_model import CFG as MODEL_CFG
from test_ecar_model import LABELS, _perturbed

# Widths that tell the AR's qkv GEMMs (3 x 32 channels) from the denoisers' (3 x 16) apart.
CFG = dataclasses.replace(MODEL_CFG, ar_depth=3, den_width=16, den_depth=(2, 3, 2))
STEPS = (2, 2, 2)


@pytest.fixture(scope='module')
def params():
  return {'ecar': _perturbed(ecar.init_params(CFG, jax.random.key(0)))}


def _both(params, policy=None):
  """(unrolled, scanned over the blocks stacked by `prepare`) samples."""
  samplers = [ecar.make_sampler(CFG, num_steps=STEPS, policy=policy, return_intermediates=True, scan_blocks=scan)
              for scan in (False, True)]
  return [s(s.prepare(params), jax.random.key(1), LABELS, cfg=2.0) for s in samplers]


def _assert_same(unrolled, scanned):
  (images_u, aux_u), (images_s, aux_s) = unrolled, scanned
  for name in ('r', 'ends'):
    for a, b in zip(aux_u[name], aux_s[name], strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(images_u, images_s, rtol=1e-5, atol=1e-5)
  assert float(np.std(images_u)) > 0.05


@pytest.mark.parametrize('ahead_rows', [0, blocks.ADALN_AHEAD_MAX_ROWS])
def test_scanned_sampler_gives_the_unrolled_token_maps_and_images(params, monkeypatch, ahead_rows):
  """With every step's adaLN outputs computed ahead of the flow loop, and with one GEMM a step."""
  monkeypatch.setattr(blocks, 'ADALN_AHEAD_MAX_ROWS', ahead_rows)
  _assert_same(*_both(params))


def test_scanned_sampler_with_the_condition_cache_gives_the_unrolled_images(params):
  _assert_same(*_both(params, ECARConditionCache(interval=2)))


def test_scanned_sampler_samples_the_same_images_from_parameters_not_prepared(params):
  sample = ecar.make_sampler(CFG, num_steps=STEPS, scan_blocks=True)
  prepared = sample.prepare(params)
  assert 'blocks_stacked' in prepared['ecar']['ar'] and 'blocks_stacked' in prepared['ecar']['denoiser_0']
  np.testing.assert_array_equal(sample(params, jax.random.key(1), LABELS)[0],
                                sample(prepared, jax.random.key(1), LABELS)[0])


def test_scanned_sampler_traces_with_bfloat16_compute(params):
  """The scans' carries (the residual streams, the stacked caches) keep their dtypes across blocks
  in bf16, the GPU setting."""
  cfg = dataclasses.replace(CFG, dtype=jnp.bfloat16)
  ecar.make_sampler(cfg, num_steps=STEPS, scan_blocks=True).lower(params, jax.random.key(1), LABELS, cfg=2.0)


def _qkv_dots(lowered, width: int) -> int:
  """The lowered program's qkv GEMMs of a block of `width` channels (a result of 3 x width)."""
  return sum(1 for ln in lowered.as_text().splitlines()
             if 'stablehlo.dot_general' in ln and ln.endswith(f'x{3 * width}xf32>'))


def test_scanned_program_holds_one_ar_block_and_one_denoiser_block_per_stage(params):
  def count(scan):
    lowered = ecar.make_sampler(CFG, num_steps=STEPS, scan_blocks=scan).lower(params, jax.random.key(1), LABELS)
    return _qkv_dots(lowered, CFG.ar_width), _qkv_dots(lowered, CFG.den_width), lowered.as_text().count('stablehlo.while')
  ar_u, den_u, loops_u = count(False)
  ar_s, den_s, loops_s = count(True)
  assert (ar_u, den_u) == (CFG.num_stages * CFG.ar_depth, sum(CFG.den_depths))
  assert (ar_s, den_s) == (CFG.num_stages, CFG.num_stages)
  assert loops_s - loops_u == 2 * CFG.num_stages


def test_config_and_override_build_the_scanned_sampler():
  config = ecar_configs.get_config('tiny')
  assert sampling_from_config(config).settings['scan_blocks'] is False
  sampling = sampling_from_config(config, {'scan_blocks': True})
  assert sampling.settings['scan_blocks'] is True and sampling.make().scan_blocks


@pytest.mark.parametrize('scan', [False, True])
def test_prepared_parameters_hold_the_denoisers_dense_layers_in_the_compute_dtype(params, scan):
  """bf16 compute: `prepare` casts the denoisers' Dense layers once (the call would cast them each
  time), leaves the AR's and the LayerNorms' in float32, and samples the same bits."""
  cfg = dataclasses.replace(CFG, dtype=jnp.bfloat16)
  sample = ecar.make_sampler(cfg, num_steps=STEPS, scan_blocks=scan)
  prepared = sample.prepare(params)
  dtypes = lambda tree: {leaf.dtype for leaf in jax.tree_util.tree_leaves(tree)}
  assert prepared['ecar']['denoiser_0']['x_embed']['kernel'].dtype == jnp.bfloat16
  assert dtypes(prepared['ecar']['ar']) == {jnp.dtype(jnp.float32)}
  np.testing.assert_array_equal(sample(params, jax.random.key(1), LABELS)[0],
                                sample(prepared, jax.random.key(1), LABELS)[0])
