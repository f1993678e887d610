"""The train step on a toy task: accumulation, EMA, the non-finite guard, model state; GradNorm's
model state under accumulation; the schedule."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ecar
from configs import common
from ecar import gradnorm
from ecar.loss import gradnorm_step
from ecar.model import abstract_params
from test_train_families import small_ecar
from train.optimizer import decay_mask, lr_schedule, make_optimizer
from train.state import init_state
from train.step import make_train_step
from train.tasks import Task, make_task, random_stand_in
from var_models import flop_count


def _inputs(frozen, batch, key):
  return batch['image'].astype(jnp.float32) * frozen['scale']


def _toy_task() -> Task:
  """Linear regression from 'image' [B, 3] to 'label'; a label < 0 makes the loss NaN.

  Its model state counts the steps it saw (what E-CAR's GradNorm state stands for).
  """
  def init(key):
    return {'w': jax.random.normal(key, (3,)), 'b': jnp.zeros(())}, {'seen': jnp.zeros((), jnp.int32)}

  def loss(params, model_state, x, labels, key):
    pred = x @ params['w'] + params['b']
    err = jnp.mean(jnp.square(pred - labels))
    err = jnp.where(jnp.any(labels < 0), jnp.nan, err)
    return err, ({'loss/abs': jnp.mean(jnp.abs(pred - labels))}, {'seen': model_state['seen'] + 1})

  return Task('toy', 1, 1, init, {'scale': jnp.float32(0.5)}, _inputs, loss, None, ('toy', 'frozen'))


def _gradnorm_task(cfg) -> Task:
  """S = cfg.num_stages regressions from 'image' [B, 3] through one shared layer W [3, 4], stage s's
  target 'label' x (1 + 3 s) (so the stages' gradient scales differ); a deterministic loss, with
  E-CAR's GradNorm statistics (losses, per-stage gradients on W) and update as the model state."""
  stages = cfg.num_stages
  gain = 1.0 + 3.0 * jnp.arange(stages)

  def init(key):
    k1, k2 = jax.random.split(key)
    return ({'shared': jax.random.normal(k1, (3, 4)), 'heads': jax.random.normal(k2, (stages, 4))},
            ecar.init_gradnorm(cfg))

  def stage_losses(params, x, labels):
    pred = x @ params['shared'] @ params['heads'].T
    return jnp.mean(jnp.square(pred - labels[:, None] * gain), axis=0)

  def loss(params, gn, x, labels, key):
    losses = stage_losses(params, x, labels)
    p = jax.lax.stop_gradient(params)
    grads = jnp.stack([jax.grad(lambda w: stage_losses({**p, 'shared': w}, x, labels)[s])(p['shared'])
                       for s in range(stages)])
    return jnp.sum(gn.weights * losses), ({}, {'losses': losses, 'grads': {'shared': grads}})

  return Task('toy_gradnorm', 1, 1, init, {'scale': jnp.float32(0.5)}, _inputs, loss, None, ('toy', 'frozen'),
              update_state=functools.partial(gradnorm_step, cfg))


def _setup(task=None, **train):
  t = common.train_config(**{'lr': 0.1, 'warmup_steps': 0, 'ema_decay': 0.5, **train})
  sched = lr_schedule(t)
  tx = make_optimizer(t, sched)
  task = task or _toy_task()
  state = init_state(task.init, tx, jax.random.key(0))
  step = jax.jit(make_train_step(task, tx, sched, t.grad_accum, t.ema_decay))
  return task, state, step


def _batch(labels):
  x = np.arange(len(labels) * 3, dtype=np.float32).reshape(len(labels), 3) % 5
  return {'image': jnp.asarray(x), 'label': jnp.asarray(labels, jnp.float32)}


def test_gradient_accumulation_equals_the_full_batch_step():
  task, state, step = _setup()
  _, _, step4 = _setup(grad_accum=4)
  batch = _batch([1., 2., 3., 4., 5., 6., 7., 8.])
  one, m1 = step(state, task.frozen, batch)
  four, m4 = step4(state, task.frozen, batch)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), one.params, four.params)
  np.testing.assert_allclose(m1['loss'], m4['loss'], rtol=1e-5)
  np.testing.assert_allclose(m1['loss/abs'], m4['loss/abs'], rtol=1e-5)
  assert int(one.model_state['seen']) == 1 and int(four.model_state['seen']) == 4


def test_gradnorm_under_accumulation_equals_one_update_on_the_full_batch():
  """The weights move once per optimizer step, from the statistics of the whole batch: Adam's moments,
  the first step's losses and the weights equal those of the step without accumulation."""
  task = _gradnorm_task(ecar.ecar_config(small_ecar()))
  _, state, step = _setup(task)
  _, _, step4 = _setup(task, grad_accum=4)
  one = four = state
  for labels in ([1., 2., 3., 4., 5., 6., 7., 8.], [2., -1., 0., 3., 1., 1., 4., 2.]):
    one, m1 = step(one, task.frozen, _batch(labels))
    four, m4 = step4(four, task.frozen, _batch(labels))
    np.testing.assert_allclose(m1['gradnorm/g0'], m4['gradnorm/g0'], rtol=1e-5)
  assert int(one.model_state.step) == int(four.model_state.step) == 2
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), one.model_state,
               four.model_state)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), one.params, four.params)
  assert float(jnp.max(jnp.abs(one.model_state.weights - 1.0))) > 1e-3  # the weights moved


def test_ecar_gradnorm_updates_once_per_step_from_the_whole_batch_statistics():
  """E-CAR's task with grad_accum=2: each step's GradNorm state is one update of the previous one from
  the step's stage losses and gradient norms (the whole batch's). Random stand-in params (no zero
  layers, so the shared layer has gradient from the first step; and no init to compile)."""
  config = small_ecar()
  config.train.update(grad_accum=2, warmup_steps=0)
  cfg = ecar.ecar_config(config)
  params = random_stand_in(abstract_params(cfg), 0)
  task = dataclasses.replace(make_task(config), init=lambda key: (params, ecar.init_gradnorm(cfg)))
  t, g = config.train, config.gradnorm
  tx = make_optimizer(t, lr_schedule(t))
  step = jax.jit(make_train_step(task, tx, lr_schedule(t), t.grad_accum, t.ema_decay))
  state = init_state(task.init, tx, jax.random.key(0))
  images = np.random.default_rng(0).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
  batch = {'image': jnp.asarray(images), 'label': jnp.arange(4) % 2}
  stages = range(config.model.num_stages)
  for _ in range(2):
    new, metrics = step(state, task.frozen, batch)
    losses, norms = (jnp.asarray([metrics[f'{name}{s}'] for s in stages]) for name in ('loss/stage', 'gradnorm/g'))
    want, _ = gradnorm.update(state.model_state, losses, norms, lr=g.lr, alpha=g.alpha, min_weight=g.min_weight)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), new.model_state, want)
    assert not np.allclose(new.model_state.weights, state.model_state.weights)
    state = new


def test_step_flops_count_every_micro_batch():
  task, state, _ = _setup()
  batch = _batch([1., 2., 3., 4., 5., 6., 7., 8.])
  counts = []
  for accum in (1, 4):
    t = common.train_config(lr=0.1, grad_accum=accum)
    step = make_train_step(task, make_optimizer(t, lr_schedule(t)), lr_schedule(t), accum, 0.5)
    counts.append(flop_count.flops(step, state, task.frozen, batch))
  # x @ w over the batch: forward and the gradient of w (2 FLOPs per multiply-add)
  assert counts[0] == counts[1] == 2 * (2 * 8 * 3)


def test_ema_follows_the_params_at_its_decay():
  task, state, step = _setup(ema_decay=0.5)
  new, _ = step(state, task.frozen, _batch([1., 2., 3., 4.]))
  want = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, state.ema_params, new.params)
  jax.tree.map(np.testing.assert_allclose, new.ema_params, want)
  assert not np.allclose(new.params['w'], state.params['w'])


def test_a_non_finite_step_changes_nothing_but_the_counters():
  task, state, step = _setup()
  good, _ = step(state, task.frozen, _batch([1., 2., 3., 4.]))
  bad, metrics = step(good, task.frozen, _batch([1., -1., 3., 4.]))
  assert not np.isfinite(metrics['loss'])
  for name in ('params', 'ema_params', 'opt_state', 'model_state'):
    jax.tree.map(np.testing.assert_array_equal, getattr(bad, name), getattr(good, name))
  assert (int(bad.step), int(bad.skipped), int(bad.bad_in_a_row)) == (2, 1, 1)
  worse, _ = step(bad, task.frozen, _batch([-1., 2., 3., 4.]))
  assert int(worse.bad_in_a_row) == 2
  healed, metrics = step(worse, task.frozen, _batch([1., 2., 3., 4.]))
  assert (int(healed.step), int(healed.skipped), int(healed.bad_in_a_row)) == (4, 2, 0)
  assert np.isfinite(metrics['loss']) and not np.array_equal(healed.params['w'], good.params['w'])
  # The schedule counts applied updates only.
  assert int(healed.updates) == 2


def test_steps_draw_fresh_randomness_from_the_state_rng():
  task, state, step = _setup()
  a, _ = step(state, task.frozen, _batch([1., 2., 3., 4.]))
  b, _ = step(a, task.frozen, _batch([1., 2., 3., 4.]))
  assert not np.array_equal(state.rng, a.rng) and not np.array_equal(a.rng, b.rng)


def test_warmup_then_each_decay_reaches_its_end():
  for schedule, mid in (('constant', 1.0), ('cosine', 0.5 * (1 + 0.1)), ('linear', 0.55)):
    t = common.train_config(lr=2.0, steps=110, warmup_steps=10, warmup_init=0.1, schedule=schedule,
                            end_lr_fraction=0.1)
    s = lr_schedule(t)
    np.testing.assert_allclose([s(0), s(5), s(10)], [0.2, 1.1, 2.0], rtol=1e-6)
    np.testing.assert_allclose(s(60), 2.0 * mid, rtol=1e-5)
    np.testing.assert_allclose(s(110), 2.0 if schedule == 'constant' else 0.2, rtol=1e-5)


def test_weight_decay_skips_vectors_and_named_parameters():
  params = {'blocks_0': {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)}, 'pos_start': jnp.ones((1, 2, 2)),
            'lvl_embed': {'embedding': jnp.ones((3, 2))}}
  mask = decay_mask(params, ('pos_start', 'lvl_embed'))
  assert mask == {'blocks_0': {'kernel': True, 'bias': False}, 'pos_start': False,
                  'lvl_embed': {'embedding': False}}


def test_unknown_optimizer_or_schedule_names_the_key():
  with pytest.raises(ValueError, match='config.train.optimizer'):
    make_optimizer(common.train_config(optimizer='sgd'), lambda s: 1.0)
  with pytest.raises(ValueError, match='config.train.schedule'):
    lr_schedule(common.train_config(schedule='step'))
