"""The fidelity runner: its metrics against hand-computed values and restatements, and one run on a tiny
config with random weights (function and command line)."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from accel import ECARConditionCache, FastVAR, LazyMAR, metrics
from accel.fidelity import compare, file_name, parse_seeds, run_samplers
from sampling import family_from_config
from accel.specs import policy_from_spec
from configs import ecar as ecar_configs
from configs import mar as mar_configs
from configs import var as var_configs

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_psnr_of_a_uniform_offset_and_of_equal_images():
  ref = np.full((2, 16, 16, 3), 0.5, np.float32)
  np.testing.assert_allclose(metrics.psnr(ref, ref + np.float32(0.1)), [20.0, 20.0], rtol=1e-5)
  assert np.all(np.isinf(metrics.psnr(ref, ref)))


def _ssim_restated(x, y):
  """Every 11 x 11 window in turn, Gaussian-weighted statistics per channel (float64)."""
  t = np.arange(11) - 5
  g = np.exp(-t ** 2 / 4.5)
  w = np.outer(g, g) / np.outer(g, g).sum()
  vals = []
  for i in range(x.shape[0] - 10):
    for j in range(x.shape[1] - 10):
      for c in range(3):
        a, b = x[i:i + 11, j:j + 11, c], y[i:i + 11, j:j + 11, c]
        ma, mb = (w * a).sum(), (w * b).sum()
        va, vb, cov = (w * a * a).sum() - ma ** 2, (w * b * b).sum() - mb ** 2, (w * a * b).sum() - ma * mb
        vals.append((2 * ma * mb + 1e-4) * (2 * cov + 9e-4) / ((ma ** 2 + mb ** 2 + 1e-4) * (va + vb + 9e-4)))
  return np.mean(vals)


def test_ssim_matches_a_windowed_restatement_and_is_one_on_equal_images():
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(2, 13, 14, 3)).astype(np.float32)
  y = np.clip(x + rng.normal(0, 0.1, x.shape), 0, 1).astype(np.float32)
  np.testing.assert_allclose(metrics.ssim(x, y), [_ssim_restated(x[i], y[i]) for i in range(2)], rtol=1e-4)
  np.testing.assert_allclose(metrics.ssim(x, x), [1.0, 1.0], rtol=1e-6)
  with pytest.raises(ValueError, match='SSIM needs images of at least 11 px'):
    metrics.ssim(x[:, :8, :8], y[:, :8, :8])


def test_token_agreement_is_per_scale_over_the_scales_both_ran():
  a = [np.array([[1, 2]]), np.array([[1, 2, 3, 4]]), np.array([[5]])]
  b = [np.array([[1, 2]]), np.array([[1, 0, 3, 0]])]
  assert metrics.token_agreement(a, b) == [1.0, 0.5]


def test_parse_seeds():
  assert parse_seeds('0-3,7') == [0, 1, 2, 3, 7]
  with pytest.raises(ValueError, match='--seeds'):
    parse_seeds('3-1')


def test_compare_on_a_tiny_model_writes_table_pairs_and_per_image_figures(tmp_path):
  family = family_from_config(var_configs.get_config('tiny'), overrides=dict(cfg=1.5, top_k=0, top_p=1.0))
  policy = FastVAR(ratios=((4, 0.5), (8, 1.0)), cache_at=2)
  seeds, labels = [0, 1, 2], np.array([3, 1, 4], np.int32)
  table = compare(family, {'fastvar:tiny': policy}, seeds, labels, 2, str(tmp_path), grid=3)
  assert table.splitlines()[-1].startswith('| fastvar:tiny | 3 |')
  record = json.loads((tmp_path / 'fastvar_tiny.json').read_text())
  assert len(record['psnr']) == len(record['ssim']) == 3 and record['lpips'] is None
  assert len(record['agreement']) == 3 and record['agreement'][:2] == [1.0, 1.0]  # scales before pruning
  assert record['baseline_latency_ms'] > 0 and record['accelerated_peak_bytes'] > 0
  grid = np.asarray(Image.open(tmp_path / 'fastvar_tiny.png'))
  assert grid.shape[0] == 32 + 4 and grid.shape[1] == 4 * (2 * 32 + 12)
  assert os.path.exists(tmp_path / 'summary.md')


def test_a_policy_spec_names_its_files_without_shell_characters():
  assert file_name('fastvar:infinity_2b[blocks=(3, 4)]') == 'fastvar_infinity_2b_blocks=_3_4'
  assert file_name('lazymar:official[decoder_sizes=1]') == 'lazymar_official_decoder_sizes=1'
  assert file_name('fastvar:var256+lazyvar:var256') == 'fastvar_var256__lazyvar_var256'


def test_samplers_compiled_side_by_side_sample_what_they_sample_compiled_one_at_a_time():
  family = family_from_config(var_configs.get_config('tiny'), overrides=dict(cfg=1.5, top_k=0, top_p=1.0))
  policies = {'base': None, 'fastvar': FastVAR(ratios=((4, 0.5), (8, 1.0)), cache_at=2)}
  seeds, labels = [0, 1, 2], np.array([3, 1, 4], np.int32)
  one, three = (run_samplers(family, policies, seeds, labels, 2, workers) for workers in (1, 3))
  for a, b in zip(one, three, strict=True):
    np.testing.assert_array_equal(a.images, b.images)
    assert a.images.shape == (3, 32, 32, 3) and a.compile_s > 0
  assert not np.array_equal(one[0].indices[-1], one[1].indices[-1])   # the policy pruned the last scale


@pytest.mark.parametrize('variant,spec,policy', [
    ('mar', 'lazymar:no_decoder', LazyMAR(scaled=True, decoder=False, head_skip=(1,))),  # tiny: 1 + 2 blocks
    ('ecar', 'ecarcache:every_2', ECARConditionCache(interval=2))])
def test_compare_runs_mar_and_ecar_policies_and_the_baseline_against_itself(tmp_path, variant, spec, policy):
  config = (mar_configs if variant == 'mar' else ecar_configs).get_config('tiny')
  family = family_from_config(config, overrides=dict(num_steps=6))
  seeds, labels = [0, 1], np.array([3, 1], np.int32)
  table = compare(family, {spec: policy, 'baseline': policy_from_spec('baseline', family.name)}, seeds, labels, 2,
                  str(tmp_path), grid=2)
  rows = table.splitlines()
  assert rows[-2].startswith(f'| {spec} | 2 |') and rows[-1].startswith('| baseline | 2 | 2 | inf |')
  record = json.loads((tmp_path / f"{spec.replace(':', '_')}.json").read_text())
  assert record['agreement'] is None and len(record['ssim']) == 2 
  assert record['options']['num_diffusion_steps' if variant == 'mar' else 'num_steps'] == 6


def test_family_rejects_settings_of_another_family_and_policies_of_another_family():
  with pytest.raises(ValueError, match=r"\['top_k'\] do not apply to config.family='ecar'"):
    family_from_config(ecar_configs.get_config('tiny'), overrides=dict(top_k=5))
  with pytest.raises(ValueError, match="accelerates MAR samplers, not a 'var' config"):
    policy_from_spec('lazymar:official', 'var')
  with pytest.raises(ValueError, match="composes next-scale"):
    policy_from_spec('ecarcache:every_2+baseline', 'ecar')


@pytest.mark.parametrize('policy, error', [
    ('fastvar:infinity_2b', 'FastVAR.ratios: scale 32 is not in the schedule'),
    # settings whose values hold commas, in a comma-separated list
    ('fastvar:skip2[ratios=((8, 1.0),)],fastvar:skip2[ratios=((4, 0.5),)][cache_at=2][blocks=(0, 99)]',
     'FastVAR.blocks: block 99 is past the depth 2'),
])
def test_command_line_rejects_a_preset_that_does_not_fit_before_compiling(tmp_path, policy, error):
  cmd = [sys.executable, '-m', 'accel.compare', '--config', 'configs/var.py:tiny', '--policy', policy,
         '--out', str(tmp_path)]
  res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert res.returncode != 0 and error in res.stderr
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize('flag, error', [
    ('--seed=3', "--seed: accel.compare samples each of --seeds"),
    ('--temperature=0.9', "--temperature applies to MAR configs, not to config.family='var'"),
    ('--labels=1,a', "--labels must be integers, got ['1', 'a']"),
])
def test_command_line_shares_the_sampling_flags_and_their_checks(tmp_path, flag, error):
  cmd = [sys.executable, '-m', 'accel.compare', '--config', 'configs/var.py:tiny', '--policy', 'fastvar:tiny',
         '--out', str(tmp_path), flag]
  res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert res.returncode != 0 and error in res.stderr
  assert not os.listdir(tmp_path)
