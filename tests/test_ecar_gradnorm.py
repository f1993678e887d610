"""GradNorm: balancing gradient norms on a shared layer, favouring the slower task, keeping the weights' sum."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ecar import gradnorm

ARGS = dict(lr=0.02, alpha=1.5, min_weight=1e-3)


def test_weights_balance_two_losses_with_different_gradient_scales():
  """Two regressions through one shared layer W, the second 10x steeper; W trains on the weighted
  sum while GradNorm moves the weights until the weighted gradient norms on W match their targets,
  G_1 / G_0 = (r_1 / r_0)^alpha (balanced training rates)."""
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.normal(size=(16, 4)), jnp.float32) for _ in range(2))
  w_star = jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)
  ya, yb = a @ w_star, b @ w_star  # consistent tasks: both can reach zero

  def losses(w):
    return jnp.stack([jnp.mean((a @ w - ya) ** 2), 10.0 * jnp.mean((b @ w - yb) ** 2)])

  @jax.jit
  def step(w, state):
    ls = losses(w)
    norms = jnp.stack([jnp.linalg.norm(jax.grad(lambda v: losses(v)[i])(w)) for i in range(2)])
    state, diag = gradnorm.update(state, ls, norms, **ARGS)
    w = w - 0.01 * jax.grad(lambda v: jnp.sum(state.weights * losses(v)))(w)
    return w, state, diag

  w, state = jnp.zeros((4, 2)), gradnorm.init_state(2)
  imbalance = lambda d: abs(float(jnp.log(d['G'][1] / d['G'][0]) - ARGS['alpha'] * jnp.log(d['ratio'][1] / d['ratio'][0])))
  imbalance0 = imbalance(step(w, state)[2])
  for _ in range(150):
    w, state, diag = step(w, state)
    assert float(jnp.sum(state.weights)) == pytest.approx(2.0, rel=1e-6)
  assert imbalance0 > 1.5
  assert float(state.weights[1]) < 0.5 < 1.5 < float(state.weights[0])
  assert imbalance(diag) < 0.2 * imbalance0
  assert int(state.step) == 150


def test_initial_losses_are_recorded_at_the_first_step_only():
  state = gradnorm.init_state(3)
  state, _ = gradnorm.update(state, jnp.array([1.0, 2.0, 3.0]), jnp.ones(3), **ARGS)
  state, _ = gradnorm.update(state, jnp.array([5.0, 5.0, 5.0]), jnp.ones(3), **ARGS)
  np.testing.assert_array_equal(state.initial_losses, [1.0, 2.0, 3.0])


def test_slower_task_gains_weight():
  """Equal gradient norms, but task 1 has not moved from its initial loss while task 0 halved:
  r_1 > r_0, so task 1's target is larger and its weight grows."""
  state = gradnorm.init_state(2)
  state, _ = gradnorm.update(state, jnp.array([1.0, 1.0]), jnp.array([1.0, 1.0]), **ARGS)
  np.testing.assert_allclose(state.weights, [1.0, 1.0], atol=1e-6)  # balanced: nothing to move
  for _ in range(20):
    state, diag = gradnorm.update(state, jnp.array([0.5, 1.0]), jnp.array([1.0, 1.0]), **ARGS)
  assert float(diag['ratio'][1]) > 1 > float(diag['ratio'][0])
  assert float(state.weights[1]) > 1.2 > 0.8 > float(state.weights[0]) and float(jnp.sum(state.weights)) == pytest.approx(2.0)


def test_weights_stay_positive():
  state = gradnorm.init_state(2)
  for _ in range(50):
    state, _ = gradnorm.update(state, jnp.array([1.0, 1.0]), jnp.array([1.0, 100.0]), lr=1.0, alpha=1.5,
                               min_weight=1e-3)
  assert float(jnp.min(state.weights)) > 0 and float(jnp.sum(state.weights)) == pytest.approx(2.0)
