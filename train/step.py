"""The train step: one pure function of (state, frozen, batch), compiled whole.

Gradients are averaged over `grad_accum` micro-batches (a `lax.scan`; micro-batch i
is rows i, i + A, i + 2A, ... so each is split over every device like the batch).
The model state either advances with every micro-batch's loss or, for a task with
`update_state` (E-CAR's GradNorm), changes once per step from the loss's statistics
averaged over the micro-batches, as one step on the full batch would change it; a
task's `taps` (zero inputs of its loss) are differentiated with the parameters, in
the same backward pass, and their gradient joins those statistics.
A step whose loss or gradient norm is not finite changes nothing but the counters
(and the RNG): parameters, EMA, optimizer and model state stay as they were.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from absl import logging

from train import mesh as mesh_lib
from train.state import TrainState
from train.tasks import Task
from var_models import flop_count


def _micro_batches(batch: dict, accum: int) -> dict:
  """{name: [B, ...]} -> {name: [A, B / A, ...]}, micro-batch i = rows i::A."""
  def split(x):
    return jnp.swapaxes(x.reshape((x.shape[0] // accum, accum) + x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def _global_norm(tree) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _select(ok, new, old):
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def make_train_step(task: Task, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_accum: int, ema_decay: float):
  """-> step(state, frozen, batch) -> (state, metrics {name: float32 []})."""
  threaded = task.update_state is None  # the loss returns the new model state, not statistics

  def loss_and_grads(params, model_state, frozen, batch, key):
    """-> (loss, metrics, new model state or statistics, grads) of one (micro-)batch."""
    k_in, k_loss = jax.random.split(key)
    inputs = task.inputs(frozen, batch, k_in)
    if task.taps is None:
      grad_fn = jax.value_and_grad(task.loss, has_aux=True)
      (loss, (metrics, aux)), grads = grad_fn(params, model_state, inputs, batch['label'], k_loss)
      return loss, metrics, aux, grads
    grad_fn = jax.value_and_grad(task.loss, argnums=(0, 5), has_aux=True)
    (loss, (metrics, aux)), (grads, tap_grads) = grad_fn(params, model_state, inputs, batch['label'], k_loss,
                                                         task.taps())
    return loss, metrics, {**aux, 'taps': tap_grads}, grads

  def accumulated(params, model_state, frozen, batch, key):
    """Means over the micro-batches; the model state threaded through them, or statistics averaged."""
    if grad_accum == 1:
      return loss_and_grads(params, model_state, frozen, batch, key)
    add = lambda a, b: jax.tree.map(jnp.add, a, b)

    def body(carry, xs):
      i, micro = xs
      loss_sum, metric_sum, aux, grad_sum = carry
      loss, metrics, new, grads = loss_and_grads(params, aux if threaded else model_state, frozen, micro,
                                                 jax.random.fold_in(key, i))
      return (loss_sum + loss, add(metric_sum, metrics), new if threaded else add(aux, new),
              add(grad_sum, grads)), None

    micro = _micro_batches(batch, grad_accum)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(loss_and_grads, params, model_state, frozen, first, key)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    carry = (zeros[0], zeros[1], model_state if threaded else zeros[2], zeros[3])
    (loss, metrics, aux, grads), _ = jax.lax.scan(body, carry, (jnp.arange(grad_accum), micro))
    mean = lambda t: jax.tree.map(lambda x: x / grad_accum, t)
    return mean(loss), mean(metrics), aux if threaded else mean(aux), mean(grads)

  def step(state: TrainState, frozen, batch):
    rng, key = jax.random.split(jax.random.wrap_key_data(state.rng))
    loss, metrics, aux, grads = accumulated(state.params, state.model_state, frozen, batch, key)
    if threaded:
      model_state = aux
    else:
      model_state, state_metrics = task.update_state(state.model_state, aux)
      metrics = {**metrics, **state_metrics}
    grad_norm = _global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ema = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, state.ema_params, params)
    new = state.replace(
        step=state.step + 1,
        skipped=state.skipped + (~ok).astype(jnp.int32),
        bad_in_a_row=jnp.where(ok, 0, state.bad_in_a_row + 1),
        params=_select(ok, params, state.params),
        ema_params=_select(ok, ema, state.ema_params),
        opt_state=_select(ok, opt_state, state.opt_state),
        model_state=_select(ok, model_state, state.model_state),
        rng=jax.random.key_data(rng))
    out = {'loss': loss, 'grad_norm': grad_norm, 'lr': schedule(state.updates),
           'skipped': new.skipped, 'bad_in_a_row': new.bad_in_a_row}
    out.update(metrics)
    return new, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), out)

  return step


def compile_train_step(task: Task, tx: optax.GradientTransformation, schedule: optax.Schedule, t, mesh,
                       shardings, state: TrainState, frozen, batch: dict,
                       check_lowered: Optional[Callable[[str], None]] = None):
  """The step compiled for these arrays' shardings, the state donated; `check_lowered(text)` sees
  its StableHLO before XLA compiles it. -> (compiled, compile seconds, matmul FLOPs per device)."""
  step = make_train_step(task, tx, schedule, t.grad_accum, t.ema_decay)
  frozen_sh = jax.tree.map(lambda x: x.sharding, frozen)
  batch_sh = jax.tree.map(lambda x: x.sharding, batch)
  jitted = jax.jit(step, in_shardings=(shardings, frozen_sh, batch_sh),
                   out_shardings=(shardings, mesh_lib.replicated(mesh)), donate_argnums=0)
  t0 = time.perf_counter()
  traced = jitted.trace(state, frozen, batch)
  t1 = time.perf_counter()
  lowered = traced.lower()
  if check_lowered is not None:
    check_lowered(lowered.as_text())
  t2 = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  logging.info('compiled the train step in %.1f s (trace %.1f s, lower and check %.1f s, XLA %.1f s)', seconds, t1 - t0,
               t2 - t1, seconds - (t2 - t0))
  return compiled, seconds, flop_count.jaxpr_flops(traced.jaxpr.jaxpr) / mesh.size
