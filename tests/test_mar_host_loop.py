"""MAR's sampler driven from the host (`host_loop=True`): a program per distinct iteration body that
scans consecutive alike iterations, sampling what the one-program sampler samples, decisions included."""
import itertools
import math

import jax
import ml_collections
import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver

from accel.lazymar import LazyMAR
from configs import mar as mar_configs
from sampling import flags as sampling_flags
from sampling import sampling_from_config
from var_models.mar.host_loop import HostLoop
from var_models.mar.sampler import make_mar_sampler
from test_mar_sampler import LABELS, VAE_CFG, _params
from test_mar_scan_sampler import CFG, NUM_ITER, TINY


@pytest.fixture(scope='module')
def params():
  return _params(CFG)


def _pair(params, **kw):
  """(one program, host loop) samples of the same call."""
  out = []
  for host_loop in (False, True):
    sample = make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, host_loop=host_loop, **kw)
    out.append(sample(sample.prepare(params), jax.random.key(3), LABELS, cfg=3.0))
  return out


def test_host_loop_lazymar_makes_the_one_programs_decisions_and_pixels(params):
  (images, aux), (host_images, host_aux) = _pair(params, policy=LazyMAR(**TINY), record=True)
  assert sorted(aux['iterations']) == sorted(host_aux['iterations'])
  for name, value in aux['iterations'].items():
    np.testing.assert_array_equal(value, host_aux['iterations'][name], err_msg=name)
  np.testing.assert_array_equal(aux['tokens'], host_aux['tokens'])
  np.testing.assert_array_equal(images, host_images)


def test_host_loop_scanned_baseline_at_several_encoder_lengths_samples_the_one_programs_pixels(params):
  (images, aux), (host_images, host_aux) = _pair(params, scan_blocks=True, encoder_sizes=2)
  np.testing.assert_array_equal(aux['tokens'], host_aux['tokens'])
  np.testing.assert_array_equal(images, host_images)


def test_host_loop_takes_the_teacher_forced_tokens_and_given_draws(params):
  """The per-iteration draws and forced tokens are sliced per iteration in each part as the scan
  slices them."""
  rng = np.random.default_rng(1)
  b, n, d = len(LABELS), CFG.seq_len, CFG.token_embed_dim
  orders = np.stack([rng.permutation(n) for _ in range(b)])
  forced = rng.standard_normal((NUM_ITER, b, n, d)).astype(np.float32)
  out = []
  for host_loop in (False, True):
    sample = make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, host_loop=host_loop, num_diffusion_steps=4)
    out.append(sample(params, jax.random.key(3), LABELS, cfg=2.0, orders=orders, forced_tokens=forced)[1]['tokens'])
  np.testing.assert_array_equal(*out)


def test_host_loop_lowers_one_program_per_distinct_iteration_body_called_along_the_schedule(params):
  """Each distinct (plan, encoder length, head cache) is one program scanning the gcd of its runs'
  lengths; its calls in `order` follow the schedule iteration by iteration."""
  sample = make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, policy=LazyMAR(**TINY), host_loop=True)
  lowered = sample.lower(params, jax.random.key(3), LABELS, cfg=3.0)
  assert isinstance(lowered, HostLoop)
  program = sample.program(len(LABELS))
  per_iter = list(zip(program.plans, program.encoder_lengths, program.head_caches))
  bodies = list(dict.fromkeys(per_iter))
  assert len(lowered.runs) == len(lowered.lengths) == len(bodies) > 1
  called = [bodies[r] for r in lowered.order for _ in range(lowered.lengths[r])]
  assert called == per_iter
  runs = [(body, len(list(group))) for body, group in itertools.groupby(per_iter)]
  assert list(lowered.lengths) == [math.gcd(*(n for b, n in runs if b == body)) for body in bodies]


def test_host_loop_calls_a_run_of_alike_iterations_as_one_scan(params):
  sample = make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, encoder_sizes=2, host_loop=True)
  lowered = sample.lower(params, jax.random.key(3), LABELS, cfg=3.0)
  assert len(lowered.order) == len(lowered.runs) == 2 and sum(lowered.lengths) == NUM_ITER


def test_host_loop_runs_write_the_carry_in_its_own_buffers(params):
  """Every run writes each carry leaf (the tokens, the policy's state) where it read it, so the
  addresses XLA recorded in its CUDA graphs stay valid from call to call."""
  sample = make_mar_sampler(CFG, VAE_CFG, num_iter=NUM_ITER, policy=LazyMAR(**TINY), host_loop=True)
  args = sample.arguments(params, jax.random.key(3), LABELS, cfg=3.0)
  loop = sample.lower(*args[:3], cfg=3.0).compile()
  cast, ctx, carry = loop.begin(*args)
  weights, head = loop.weights(args[0], cast)
  pointers = lambda tree: {jax.tree_util.keystr(p): a.unsafe_buffer_pointer()
                           for p, a in jax.tree_util.tree_leaves_with_path(tree)}
  start = pointers(carry)
  assert {"['tokens']", "['state']['encoded']"} <= set(start)
  for r in loop.order:
    carry, record = loop.runs[r](weights, head, ctx, carry)
    assert pointers(carry) == start and record is None


def test_the_config_and_its_override_choose_the_host_loop():
  config = mar_configs.get_config('tiny')
  assert sampling_from_config(config).settings['host_loop'] is False
  assert sampling_from_config(config, {'host_loop': True}).make().host_loop is True


def test_host_loop_is_a_flag_of_mar_alone():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(host_loop=True):
    sampling_flags.check_family(ml_collections.ConfigDict({'family': 'mar'}))
    assert sampling_flags.overrides('mar', 3.0)['host_loop'] is True
    with pytest.raises(ValueError, match="--host_loop applies to MAR configs, not to config.family='var'"):
      sampling_flags.check_family(ml_collections.ConfigDict({'family': 'var'}))
