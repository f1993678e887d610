"""MAR's sampler with its encoder and decoder blocks scanned (`scan_blocks=True`): the unrolled
sampler's tokens and LazyMAR's decisions, one block per run of alike blocks in the program."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver

from accel.lazymar import LazyMAR
from configs import mar as mar_configs
from sampling import flags as sampling_flags
from sampling import sampling_from_config
from var_models.mar import model as mar_lib
from var_models.mar.policy import IterPlan, Site
from var_models.mar.schedule import MARSchedule, mask_schedule
from var_models.mar.sampler import make_mar_sampler
from var_models.nn.policy import Binding
from var_models.nn.scan import scan_runs
from test_mar_sampler import LABELS, MAR_CFG, VAE_CFG, _params

# 3 encoder blocks; decoder blocks 0 (no hooks), 1 (LazyMAR's similarity block), 2-4 (one run).
CFG = dataclasses.replace(MAR_CFG, encoder_depth=3, decoder_depth=5)
NUM_ITER = 6
TINY = dict(refresh_start=2, refresh_every=3, ratios=(1.0, 1.0, 1.0, 0.5, 0.2, 0.2), similarity_block=1,
            extra_tokens=1, head_interval=3, head_skip=(1,))


@pytest.fixture(scope='module')
def params():
  return _params(CFG)


def _both(params, policy=None, record=False):
  """(unrolled, scanned over the blocks stacked by `prepare`) samples."""
  samplers = [make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, policy=policy, record=record, scan_blocks=scan)
              for scan in (False, True)]
  return [s(s.prepare(params), jax.random.key(3), LABELS, cfg=3.0) for s in samplers]


def test_scanned_baseline_samples_the_unrolled_tokens(params):
  (images_u, aux_u), (images_s, aux_s) = _both(params)
  np.testing.assert_allclose(aux_u['tokens'], aux_s['tokens'], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(images_u, images_s, rtol=1e-5, atol=1e-5)


def test_scanned_sampler_samples_the_same_tokens_from_parameters_not_prepared(params):
  sample = make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, scan_blocks=True)
  prepared = sample.prepare(params)
  assert {'encoder_blocks_stacked', 'decoder_blocks_stacked'} <= set(prepared['mar'])
  assert 'encoder_blocks_0' not in prepared['mar']
  np.testing.assert_array_equal(sample(params, jax.random.key(3), LABELS, cfg=3.0)[1]['tokens'],
                                sample(prepared, jax.random.key(3), LABELS, cfg=3.0)[1]['tokens'])


def test_scanned_lazymar_makes_the_unrolled_decisions_and_tokens(params):
  (_, aux_u), (_, aux_s) = _both(params, LazyMAR(**TINY), record=True)
  for name in ('refresh', 'kept', 'encoded', 'pred'):
    np.testing.assert_array_equal(aux_u['iterations'][name], aux_s['iterations'][name])
  np.testing.assert_allclose(aux_u['tokens'], aux_s['tokens'], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('scanned', [False, True])
def test_lazymar_keeps_a_kv_array_per_block_unrolled_and_one_stack_scanned(scanned):
  """Unrolled, a cached iteration scatters into and attends over each block's own K/V in place; a
  scan indexes the blocks by a traced layer, so their K/V are one array stacked on a layer axis."""
  schedule = MARSchedule(mask_schedule(CFG.seq_len, NUM_ITER), 4)
  state = LazyMAR(**TINY).bind(Binding(CFG, schedule, guided=True, scanned=scanned)).init_state(2)
  rows_l_h_d = (2, CFG.seq_len + CFG.buffer_size, CFG.encoder_num_heads, CFG.encoder_embed_dim // CFG.encoder_num_heads)
  if scanned:
    assert state['enc_k'].shape == (CFG.encoder_depth, *rows_l_h_d)
    assert state['dec_k'].shape[0] == CFG.decoder_depth - TINY['similarity_block'] - 1
  else:
    assert [a.shape for a in state['enc_k']] == [rows_l_h_d] * CFG.encoder_depth
    assert len(state['dec_k']) == CFG.decoder_depth - TINY['similarity_block'] - 1


def test_scanned_lazymar_traces_with_bfloat16_compute(params):
  """The scan carries the policy state whole: its dtypes must hold across blocks in bf16 (the GPU setting)."""
  cfg = dataclasses.replace(CFG, dtype=jnp.bfloat16)
  sample = make_mar_sampler(cfg, VAE_CFG, num_iter=NUM_ITER, policy=LazyMAR(**TINY), scan_blocks=True)
  sample.lower(params, jax.random.key(3), LABELS, cfg=3.0)


def test_lazymar_blocks_group_into_runs_around_the_similarity_block():
  policy = make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, policy=LazyMAR(**TINY)).policy
  def runs(stack, depth, plan):
    hooks = policy.block_hooks(Site(plan, stack), depth)
    return scan_runs([('plain',) if hooks is None or h is None else h.scan_group() for h in (hooks or [None] * depth)])
  cached = next(p for p in policy.plan(NUM_ITER) if p.tag not in (None, 'full'))
  assert runs('decoder', 5, cached) == [[0], [1], [2, 3, 4]]
  assert runs('encoder', 3, cached) == [[0, 1, 2]]
  assert runs('decoder', 5, IterPlan()) == [[0, 1, 2, 3, 4]]


def test_the_scanned_program_holds_one_block_per_run(params):
  """The baseline's encoder (at each of its lengths) and decoder each one run: one qkv GEMM of each
  width in the program per length."""
  def qkv_dots(scan, sizes):
    lowered = make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, scan_blocks=scan, encoder_sizes=sizes).lower(
        params, jax.random.key(0), LABELS, cfg=3.0)
    lines = [ln for ln in lowered.as_text().splitlines() if 'stablehlo.dot_general' in ln]
    return [sum(ln.endswith(f'x{3 * w}xf32>') for ln in lines) for w in (CFG.encoder_embed_dim, CFG.decoder_embed_dim)]
  assert qkv_dots(False, 2) == [2 * CFG.encoder_depth, CFG.decoder_depth]
  assert qkv_dots(True, 2) == [2, 1] and qkv_dots(True, None) == [1, 1]


def test_scanning_while_training_is_an_error(params):
  x = np.zeros((1, CFG.buffer_size + CFG.seq_len, CFG.decoder_embed_dim), np.float32)
  with pytest.raises(ValueError, match='scan only when sampling'):
    mar_lib.MAR(CFG).apply({'params': params['mar']}, x, train=True, scan=True, method=mar_lib.MAR.run_decoder)


def test_the_config_and_its_override_choose_the_scan():
  config = mar_configs.get_config('tiny')
  assert sampling_from_config(config).settings['scan_blocks'] is False
  assert sampling_from_config(config, {'scan_blocks': True}).settings['scan_blocks'] is True


def test_scan_blocks_is_a_flag_of_every_family_and_num_iter_of_mar_alone():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(scan_blocks=True):
    for family in ('var', 'mar', 'ecar'):
      sampling_flags.check_family(ml_collections.ConfigDict({'family': family}))
  with flagsaver.flagsaver(num_iter=8):
    with pytest.raises(ValueError, match="--num_iter applies to MAR configs, not to config.family='ecar'"):
      sampling_flags.check_family(ml_collections.ConfigDict({'family': 'ecar'}))
