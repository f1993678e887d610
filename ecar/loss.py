"""E-CAR's training loss: per-stage flow-matching MSE, end to end through the AR, balanced by GradNorm.

    loss, (metrics, gn_state) = loss_fn(cfg, params, gn_state, x0, labels, key)

One shared full-resolution noise per sample gives every stage its start and end
points (`flow.training_points`); each stage draws its own local time t ~ U[0, 1).
The AR sees the class (dropped to the null class with probability
cond_drop_rate) and the end points of stages 0..S-2; each denoiser predicts
end - start at x_t. Stage loss L_s = mean squared error over [B, g_s, g_s, D].
The returned loss is sum_s w_s L_s with the GradNorm weights w held constant, so
its gradient trains the AR through every stage's r_s. GradNorm's gradients
grad_W L_s are taken on the AR layer `cfg.gradnorm_layer`; they feed only the
weight update, which comes back as the new GradNormState (`train=False` leaves
it unchanged). On the default layer, the final LayerNorm (the last layer every
stage shares), they come from the training backward pass itself: stage s reads
r only at its own tokens, so the loss's gradient on zero per-stage offsets of
the norm's scale and bias (`norm_taps`) is w_s grad_W L_s; nothing is recomputed.
On any other AR layer stage s's gradient mixes every stage's tokens, and
`shared_grads` takes it by one extra backward pass per stage on stop-gradient
copies of the params.

A train step calls `loss_fn`'s two halves apart: `loss_and_stats` on each
micro-batch, differentiated with respect to the params and the taps (the loss and
GradNorm's statistics L_s and w_s grad_W L_s, means over the batch), and
`gradnorm_step` once, on the statistics averaged over the micro-batches (the full
batch's), so the weights move once per optimizer step, as in one step on the
full batch.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ecar import gradnorm
from ecar.config import ECARConfig
from ecar.flow import training_points
from ecar.model import ECAR

Array = jax.Array


def init_gradnorm(cfg: ECARConfig) -> gradnorm.GradNormState:
  """Equal stage weights (sum S); initial losses are recorded at the first training step."""
  return gradnorm.init_state(cfg.num_stages)


def _subtree(tree, path: str):
  for part in path.split('/'):
    if not isinstance(tree, Mapping) or part not in tree:
      raise ValueError(f'gradnorm layer {path!r} is not in the params (no {part!r} under it); '
                       'set config.gradnorm.layer to a path like ar/norm or ar/blocks_0/mlp/fc2')
    tree = tree[part]
  return tree


def _with_subtree(tree, path: str, value):
  head, _, rest = path.partition('/')
  return {**tree, head: _with_subtree(tree[head], rest, value) if rest else value}


def check_gradnorm_layer(cfg: ECARConfig, params) -> None:
  """Raises ValueError if cfg.gradnorm_layer names nothing in params (shapes suffice)."""
  _subtree(params, cfg.gradnorm_layer)


def _check_batch(cfg: ECARConfig, x0: Array, labels: Array) -> None:
  if x0.ndim != 4 or tuple(x0.shape[1:]) != cfg.data_shape:
    raise ValueError(f'x0 must be [B, {", ".join(map(str, cfg.data_shape))}] ({cfg.latent_space} space), '
                     f'got shape {tuple(x0.shape)}')
  if labels.shape != (x0.shape[0],) or not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(f'labels must be integers of shape ({x0.shape[0]},), got {labels.shape} {labels.dtype}')


FINAL_NORM = 'ar/norm'


def norm_taps(cfg: ECARConfig) -> dict | None:
  """Zero offsets {'scale', 'bias'} [S, C] of the final norm per stage (see `ECAR.__call__`), for
  GradNorm on the final norm; None when GradNorm is off or on another layer."""
  if cfg.gradnorm_lr <= 0 or cfg.gradnorm_layer != FINAL_NORM:
    return None
  zeros = jnp.zeros((cfg.num_stages, cfg.ar_width), jnp.float32)
  return {'scale': zeros, 'bias': zeros}


def stage_losses(cfg: ECARConfig, params, labels: Array, points: dict, taps: dict | None = None) -> Array:
  """[S] flow-matching MSE of each stage (float32)."""
  pred = ECAR(cfg).apply({'params': params}, labels, points['end'][:-1], points['x_t'], points['timestep'],
                         taps)
  return jnp.stack([jnp.mean(jnp.square(p - v)) for p, v in zip(pred, points['v'])])


def shared_grads(cfg: ECARConfig, params, labels: Array, points: dict):
  """grad_W L_s of every stage: W = the params at cfg.gradnorm_layer, each leaf with a leading [S] axis.
  No gradient flows out of it."""
  params, labels, points = jax.lax.stop_gradient((params, labels, points))
  path = cfg.gradnorm_layer
  shared = _subtree(params, path)

  def grad(s):
    return jax.grad(lambda w: stage_losses(cfg, _with_subtree(params, path, w), labels, points)[s])(shared)

  return jax.tree.map(lambda *g: jnp.stack(g), *[grad(s) for s in range(cfg.num_stages)])


def _stage_norms(grads) -> Array:
  """{leaf [S, ...]} -> [S] the norm of each stage's gradient over all of W."""
  leaves = jax.tree_util.tree_leaves(grads)
  return jnp.sqrt(sum(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), axis=1) for g in leaves))


def loss_and_stats(cfg: ECARConfig, params, gradnorm_state: gradnorm.GradNormState, x0: Array, labels: Array,
                   key: Array, taps: dict | None = None, *, train: bool = True) -> tuple[Array, tuple[dict[str, Any], dict]]:
  """x0 [B, H, W, D] in the model's data space, labels [B] -> (loss, (metrics, stats)).

  taps: `norm_taps(cfg)`, whose gradient the caller takes with the params' (its stats['taps'] for
  `gradnorm_step`), or None. stats: {'losses': L_s [S]; when training with gradnorm_lr > 0 and no
  taps, 'grads': grad_W L_s (`shared_grads`)}, means over the batch, so those of equal micro-batches
  average to the full batch's.
  """
  _check_batch(cfg, x0, labels)
  k_drop, k_noise, k_t = jax.random.split(key, 3)
  if train and cfg.cond_drop_rate > 0:
    labels = jnp.where(jax.random.uniform(k_drop, labels.shape) < cfg.cond_drop_rate, cfg.num_classes, labels)
  t = jax.random.uniform(k_t, (cfg.num_stages, x0.shape[0]), jnp.float32)
  points = training_points(cfg.flow, cfg.stage_sizes, x0, jax.random.normal(k_noise, x0.shape), t)
  losses = stage_losses(cfg, params, labels, points, taps)
  weights = jax.lax.stop_gradient(gradnorm_state.weights)
  metrics = {f'loss/stage{s}': losses[s] for s in range(cfg.num_stages)}
  metrics |= {f'gradnorm/w{s}': weights[s] for s in range(cfg.num_stages)}
  metrics['loss/unweighted'] = jnp.sum(losses)
  stats = {'losses': jax.lax.stop_gradient(losses)}
  if train and cfg.gradnorm_lr > 0 and taps is None:
    stats['grads'] = shared_grads(cfg, params, labels, points)
  return jnp.sum(weights * losses), (metrics, stats)


def gradnorm_step(cfg: ECARConfig, gradnorm_state: gradnorm.GradNormState,
                  stats: dict) -> tuple[gradnorm.GradNormState, dict[str, Array]]:
  """One GradNorm update from `loss_and_stats`' stats (of one batch, or averaged over micro-batches;
  'taps': the loss's gradient on the taps, w_s grad_W L_s) -> (new state, metrics: the gradient norms
  ||grad_W L_s|| and the relative inverse training rates)."""
  metrics = {}
  if 'taps' in stats:
    norms = _stage_norms(stats['taps']) / gradnorm_state.weights   # w_s >= gradnorm_min_weight > 0
  elif 'grads' in stats:
    norms = _stage_norms(stats['grads'])
  else:
    norms = jnp.zeros_like(stats['losses'])
  if 'taps' in stats or 'grads' in stats:
    metrics |= {f'gradnorm/g{s}': norms[s] for s in range(cfg.num_stages)}
  new_state, diag = gradnorm.update(gradnorm_state, stats['losses'], norms, lr=cfg.gradnorm_lr,
                                    alpha=cfg.gradnorm_alpha, min_weight=cfg.gradnorm_min_weight)
  metrics |= {f'gradnorm/ratio{s}': diag['ratio'][s] for s in range(cfg.num_stages)}
  return new_state, metrics


def loss_fn(cfg: ECARConfig, params, gradnorm_state: gradnorm.GradNormState, x0: Array, labels: Array,
            key: Array, *, train: bool = True) -> tuple[Array, tuple[dict[str, Any], gradnorm.GradNormState]]:
  """x0 [B, H, W, D] in the model's data space, labels [B] -> (loss, (metrics, new GradNorm state)):
  `loss_and_stats` then, when training, `gradnorm_step` on this batch's stats (the taps' gradient
  taken here by a backward pass of its own: the train step takes it with the params')."""
  taps = norm_taps(cfg) if train else None
  if taps is None:
    loss, (metrics, stats) = loss_and_stats(cfg, params, gradnorm_state, x0, labels, key, train=train)
  else:
    (loss, (metrics, stats)), tap_grads = jax.value_and_grad(
        lambda t: loss_and_stats(cfg, params, gradnorm_state, x0, labels, key, t, train=True), has_aux=True)(taps)
    stats = {**stats, 'taps': tap_grads}
  if not train:
    return loss, (metrics, gradnorm_state)
  new_state, gn_metrics = gradnorm_step(cfg, gradnorm_state, stats)
  return loss, (metrics | gn_metrics, new_state)
