"""GradNorm (Chen et al. 2018) over E-CAR's stage losses.

Loss = sum_i w_i L_i with stop-gradient weights w (sum S). Per step, with the
gradient norms g_i = ||grad_W L_i|| on a shared layer W:
  G_i = w_i g_i,  G_avg = mean_i G_i,
  r_i = (L_i / L_i(0)) / mean_j (L_j / L_j(0))     (relative inverse training rate),
  target_i = G_avg r_i^alpha                        (held constant, as in the paper),
  L_grad = sum_i |G_i - target_i|,   dL_grad / dw_i = sign(G_i - target_i) g_i,
then one Adam step on w with GradNorm's own learning rate, w <- max(w, min_weight),
and w renormalised to sum S. L_i(0) are the losses of the first step (recorded
while `step` is 0). Adam, as when the weights join the network's optimiser in
the paper's set-up: plain gradient descent would move w by lr * g_i, which
depends on the scale of the shared layer's gradients and so on the model; Adam
moves it by about lr per step whatever that scale. The floor keeps a weight
from crossing zero.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array
_B1, _B2, _EPS = 0.9, 0.999, 1e-8


@flax.struct.dataclass
class GradNormState:
  weights: Array         # [S] float32, sums to S
  initial_losses: Array  # [S] float32, L_i(0) once step > 0
  step: Array            # int32 scalar: updates done so far
  mu: Array              # [S] Adam moments of dL_grad/dw
  nu: Array


def init_state(num_tasks: int) -> GradNormState:
  ones, zeros = jnp.ones((num_tasks,), jnp.float32), jnp.zeros((num_tasks,), jnp.float32)
  return GradNormState(ones, ones, jnp.zeros((), jnp.int32), zeros, zeros)


def update(state: GradNormState, losses: Array, grad_norms: Array, *, lr: float, alpha: float,
           min_weight: float) -> tuple[GradNormState, dict]:
  """One GradNorm step from the losses L_i [S] and ||grad_W L_i|| [S] (both treated as constants).
  Returns (new state, diagnostics {'G', 'target', 'ratio'} [S])."""
  losses, grad_norms = jax.lax.stop_gradient((losses.astype(jnp.float32), grad_norms.astype(jnp.float32)))
  n = losses.shape[0]
  initial = jnp.where(state.step == 0, losses, state.initial_losses)
  g = state.weights * grad_norms
  inverse_rate = losses / jnp.maximum(initial, 1e-12)
  ratio = inverse_rate / jnp.maximum(jnp.mean(inverse_rate), 1e-12)
  target = jnp.mean(g) * ratio ** alpha
  grad = jnp.sign(g - target) * grad_norms
  step = state.step + 1
  mu = _B1 * state.mu + (1 - _B1) * grad
  nu = _B2 * state.nu + (1 - _B2) * grad * grad
  t = step.astype(jnp.float32)
  adam = (mu / (1 - _B1 ** t)) / (jnp.sqrt(nu / (1 - _B2 ** t)) + _EPS)
  w = jnp.maximum(state.weights - lr * adam, min_weight)
  w = w * (n / jnp.sum(w))
  return GradNormState(w, initial, step, mu, nu), {'G': g, 'target': target, 'ratio': ratio}
