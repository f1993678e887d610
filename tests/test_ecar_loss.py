"""E-CAR's loss: it falls on a fixed batch, trains the AR through the flows, carries GradNorm's state,
and rejects bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ecar
from ecar.config import ECARConfig

CFG = ECARConfig(image_size=8, num_classes=4, latent_space='pixel', num_stages=2, patch_size=1, ar_depth=1,
                 ar_width=32, ar_heads=2, den_depth=1, den_width=32, den_heads=2, gradnorm_lr=0.01)
STEPS = 30


def _batch():
  """Four class-coloured squares on a dark background, in [-1, 1]."""
  x = np.full((4, 8, 8, 3), -0.8, np.float32)
  for i, c in enumerate(np.eye(3).tolist() + [[1.0, 1.0, 0.0]]):
    x[i, 2 + i % 2:6, 2:6 - i % 2] = np.asarray(c) * 1.6 - 0.8
  return jnp.asarray(x), jnp.arange(4, dtype=jnp.int32)


@pytest.fixture(scope='module')
def trained():
  """(initial params, final params, per-step train metrics, final GradNorm state). Every step sees the
  same noise and times (one key), so the loss is a deterministic function of the params."""
  x0, labels = _batch()
  tx = optax.adam(3e-3)

  @jax.jit
  def step(params, opt, gn, key):
    grad_fn = jax.value_and_grad(lambda p: ecar.loss_fn(CFG, p, gn, x0, labels, key), has_aux=True)
    (_, (metrics, gn)), grads = grad_fn(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, gn, metrics

  params0 = ecar.init_params(CFG, jax.random.key(0))
  params, opt, gn = params0, tx.init(params0), ecar.init_gradnorm(CFG)
  history = []
  for _ in range(STEPS):
    params, opt, gn, metrics = step(params, opt, gn, jax.random.key(7))
    history.append({k: float(v) for k, v in metrics.items()})
  return params0, params, history, gn


def test_loss_falls_on_a_fixed_batch(trained):
  _, _, history, _ = trained
  first, last = history[0]['loss/unweighted'], history[-1]['loss/unweighted']
  assert last < 0.6 * first, (first, last)
  assert all(history[-1][f'loss/stage{s}'] < history[0][f'loss/stage{s}'] for s in range(2))


def test_flow_loss_trains_the_ar(trained):
  """End to end: the AR's blocks and class embedding move (they get gradient only through r_s)."""
  params0, params, _, _ = trained
  for path in (('blocks_0', 'mlp', 'fc1', 'kernel'), ('class_emb', 'embedding'), ('norm', 'scale')):
    a, b = params0['ar'], params['ar']
    for k in path:
      a, b = a[k], b[k]
    assert float(jnp.max(jnp.abs(a - b))) > 1e-4, path


def test_gradnorm_state_and_metrics(trained):
  _, _, history, gn = trained
  metrics = history[-1]
  assert set(metrics) >= {f'{p}{s}' for p in ('loss/stage', 'gradnorm/w', 'gradnorm/g') for s in range(2)}
  assert int(gn.step) == STEPS
  assert float(jnp.sum(gn.weights)) == pytest.approx(2.0, rel=1e-5)
  np.testing.assert_allclose(gn.initial_losses, [history[0][f'loss/stage{s}'] for s in range(2)], rtol=1e-5)
  assert all(metrics[f'gradnorm/g{s}'] > 0 for s in range(2))
  assert float(jnp.max(jnp.abs(gn.weights - 1.0))) > 1e-3  # the weights moved


def test_bad_batch_is_a_clear_error():
  params = jax.eval_shape(lambda k: ecar.init_params(CFG, k), jax.random.key(0))
  gn = ecar.init_gradnorm(CFG)
  with pytest.raises(ValueError, match=r'x0 must be \[B, 8, 8, 3\] \(pixel space\), got shape \(2, 8, 8, 4\)'):
    ecar.loss_fn(CFG, params, gn, jnp.zeros((2, 8, 8, 4)), jnp.zeros((2,), jnp.int32), jax.random.key(0))
  with pytest.raises(ValueError, match=r'labels must be integers of shape \(2,\)'):
    ecar.loss_fn(CFG, params, gn, jnp.zeros((2, 8, 8, 3)), jnp.zeros((3,), jnp.int32), jax.random.key(0))


def test_gradnorm_gradients_read_off_the_training_backward_equal_a_backward_per_stage():
  """GradNorm on the final norm: the stage gradient norms from the taps' gradient (taken with the loss's,
  as the train step does) equal ||grad L_s|| on the norm's params taken stage by stage; random params
  (no zero layer, so every stage's gradient reaches the norm) and uneven weights."""
  from ecar.loss import gradnorm_step, loss_and_stats, norm_taps
  x0, labels = _batch()
  key = jax.random.key(3)
  params = jax.jit(lambda k: jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(p.size), p.shape),
                                          ecar.init_params(CFG, k)))(jax.random.key(0))
  gn = ecar.init_gradnorm(CFG).replace(weights=jnp.array([0.4, 1.6]))
  (_, (_, stats)), taps = jax.jit(jax.value_and_grad(
      lambda t: loss_and_stats(CFG, params, gn, x0, labels, key, t), has_aux=True))(norm_taps(CFG))
  assert 'grads' not in stats   # no extra backward pass
  _, metrics = gradnorm_step(CFG, gn, {**stats, 'taps': taps})

  def stage_loss(norm, s):
    with_norm = {**params, 'ar': {**params['ar'], 'norm': norm}}
    return loss_and_stats(CFG, with_norm, gn, x0, labels, key)[1][0][f'loss/stage{s}']

  for s in range(2):
    grads = jax.jit(jax.grad(stage_loss), static_argnums=1)(params['ar']['norm'], s)
    want = np.sqrt(sum(float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(grads)))
    assert want > 1e-3
    np.testing.assert_allclose(float(metrics[f'gradnorm/g{s}']), want, rtol=1e-5)
