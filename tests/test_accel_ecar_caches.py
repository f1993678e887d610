"""E-CAR condition cache: full steps keep v_u - v_c, cached steps run the conditional half and reuse it;
a full step every step is plain CFG; settings are checked."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ecar
from accel.ecar_caches import ECARConditionCache
from ecar.policy import FlowStep
from test_ecar_model import CFG, LABELS, _perturbed
from var_models.nn.policy import Binding, Halves


def _bound(policy):
  return policy.bind(Binding(model=CFG, schedule=(4, 4, 4), guided=True))


def _halves(x, calls):
  """v_c = 2x + 1, v_u = x - 1 at x; `calls` counts the doubled and the conditional-only calls."""
  def both():
    calls.append('both')
    return 2 * x + 1, x - 1

  def cond():
    calls.append('cond')
    return 2 * x + 1
  return Halves(both, cond)


def test_cached_steps_reuse_the_last_full_steps_residual_on_the_conditional_half_only():
  policy = _bound(ECARConditionCache(interval=3))
  state = policy.init_state(len(LABELS))
  g = CFG.stage_sizes[1]
  xs = [jax.random.normal(jax.random.key(i), (len(LABELS), g, g, 3)) for i in range(4)]
  calls, residual = [], None
  for step, x in enumerate(xs):
    (v_c, v_u), state = policy.guide(FlowStep(1, jnp.int32(step)), _halves(x, calls), state)
    if step % 3 == 0:
      residual = (x - 1) - (2 * x + 1)
    np.testing.assert_allclose(v_c, 2 * x + 1, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(v_u, 2 * x + 1 + residual, rtol=1e-6, atol=1e-5)
  # lax.cond traces both branches at every step: each step calls both halves once while tracing.
  assert calls.count('both') == calls.count('cond') == 4


def test_stages_left_out_compute_both_halves():
  policy = _bound(ECARConditionCache(interval=2, stages=(-1,)))
  state = policy.init_state(1)
  x = jnp.ones((1, CFG.stage_sizes[0], CFG.stage_sizes[0], 3))
  calls = []
  (v_c, v_u), _ = policy.guide(FlowStep(0, jnp.int32(1)), _halves(x, calls), state)
  np.testing.assert_array_equal(v_c, 2 * x + 1)
  np.testing.assert_array_equal(v_u, x - 1)
  assert calls == ['both']


def test_an_unbound_cache_says_so():
  with pytest.raises(ValueError, match='unbound'):
    ECARConditionCache().init_state(1)


def test_a_full_step_every_step_matches_the_baseline_sampler():
  params = _perturbed(ecar.init_params(CFG, jax.random.key(0)))
  base = ecar.make_sampler(CFG, num_steps=(2, 2, 2))({'ecar': params}, jax.random.key(1), LABELS, cfg=2.0)[0]
  cached = ecar.make_sampler(CFG, num_steps=(2, 2, 2), policy=ECARConditionCache(interval=1))(
      {'ecar': params}, jax.random.key(1), LABELS, cfg=2.0)[0]
  np.testing.assert_allclose(cached, base, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('settings,message', [
    (dict(interval=0), 'ECARConditionCache.interval'), (dict(stages=(1, 1)), 'ECARConditionCache.stages'),
])
def test_bad_settings_name_their_field(settings, message):
  with pytest.raises(ValueError, match=message):
    ECARConditionCache(**settings)


def test_stages_outside_the_model_are_rejected_when_the_sampler_is_built():
  with pytest.raises(ValueError, match='ECARConditionCache.stages'):
    ecar.make_sampler(CFG, num_steps=6, policy=ECARConditionCache(stages=(5,)))


def test_unknown_preset_lists_the_known_ones():
  with pytest.raises(ValueError, match="unknown ECARConditionCache preset 'x'.*every_2"):
    ECARConditionCache.preset('x')
