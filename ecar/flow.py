"""E-CAR's multistage (pyramidal) flow: stage endpoints, the renoise jump, block noise, Euler steps.

Conventions. A noise level sigma mixes x_sigma = sigma * noise + (1 - sigma) * x0
(Pyramid Flow). Stage s (0 = coarsest) runs on its own grid from a start point
to an end point; its local time t goes from 0 (start) to 1 (end):
    x_t = (1 - t) * start + t * end,   velocity v = end - start,   x <- x + dt * v.
(E-CAR's rectified-flow form; Pyramid Flow writes the same path with r = 1 - t and
predicts start - end.)

Sigmas. With stage boundaries k / S (k = 0..S), boundary k has noise level
1 - k / S, quantised as Pyramid Flow's scheduler does on its grid of
`num_train_timesteps` training timesteps (sigma = (T - int(k / S * T)) / T; T = 0
keeps the exact values). Stage s ends at boundary s + 1; it starts at boundary s,
corrected for the renoise jump: with s' = 1 - sigma_raw,
    s'' = s' / (sqrt(1 + 1/gamma) * (1 - s') + s'),   sigma_start = 1 - s''.
For S = 3, gamma = 1/3, T = 1000: ends 0.667, 0.334, 0; starts 1, 0.8, 0.5007.

Training points of stage s (one shared full-resolution noise n; the stage's noise
n_s is n area-downsampled to the stage's grid and rescaled to unit variance, and
clean_s is x0 area-downsampled; PyTorch's bilinear x0.5 that Pyramid Flow uses
is exactly this 2x2 average):
    start_s = sigma_start * n_s + (1 - sigma_start) * up(clean_{s-1})   (start_0 = n_0)
    end_s   = sigma_end * n_s + (1 - sigma_end) * clean_s
with `up` nearest x2.

The jump between stages at sampling time (E-CAR appendix A.3, Pyramid Flow):
x <- alpha * up(x) + beta * b, alpha = 1 / (sqrt(1 + 1/gamma) * (1 - s') + s'),
beta = alpha * (1 - s') / sqrt(gamma), where b is block noise: i.i.d. over 2x2
blocks, each block Gaussian with covariance (1 + gamma) I - gamma 11^T. It
turns the end point of stage s - 1 (noise fully correlated inside each block)
into a sample of start_s (i.i.d. noise of level sigma_start).

Time windows. Each stage's denoiser sees a global time tau in [0, 1] (0 = noise,
1 = data): stage s covers [s / S, (s + 1) / S] ('uniform', E-CAR's partition of
the time interval) or windows proportional to its flow length sigma_start -
sigma_end ('flow_length', Pyramid Flow's timestep ratios). The time embedding
gets 1000 * tau.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from var_models.nn.resample import area_resize, nearest_resize

Array = jax.Array
TIME_SCALE = 1000.0  # tau in [0, 1] -> the timestep fed to the sinusoidal embedding


@dataclasses.dataclass(frozen=True)
class StageFlow:
  """Static per-stage constants (NumPy float64 arrays of length S)."""
  gamma: float
  raw_start_sigmas: np.ndarray
  start_sigmas: np.ndarray
  end_sigmas: np.ndarray
  jump_alpha: np.ndarray   # stage 0 has no jump: 0
  jump_beta: np.ndarray
  windows: np.ndarray      # [S, 2] global time (tau) at the stage's start and end

  @property
  def num_stages(self) -> int:
    return len(self.end_sigmas)


def _boundary_sigma(k: int, num_stages: int, num_train_timesteps: int) -> float:
  if k == num_stages:
    return 0.0
  if num_train_timesteps == 0:
    return 1.0 - k / num_stages
  t = num_train_timesteps
  return (t - int(k / num_stages * t)) / t


def _jump(raw_sigma: float, gamma: float) -> tuple[float, float]:
  """(alpha, beta) of the jump into a stage whose uncorrected start level is raw_sigma."""
  s = 1.0 - raw_sigma
  alpha = 1.0 / (math.sqrt(1.0 + 1.0 / gamma) * (1.0 - s) + s)
  return alpha, alpha * (1.0 - s) / math.sqrt(gamma)


@functools.lru_cache(maxsize=None)
def stage_flow(num_stages: int, gamma: float, num_train_timesteps: int = 1000,
               time_windows: str = 'uniform') -> StageFlow:
  raw = np.array([_boundary_sigma(k, num_stages, num_train_timesteps) for k in range(num_stages)])
  end = np.array([_boundary_sigma(k + 1, num_stages, num_train_timesteps) for k in range(num_stages)])
  jumps = np.array([(0.0, 0.0)] + [_jump(r, gamma) for r in raw[1:]])
  start = raw.copy()
  start[1:] = 1.0 - jumps[1:, 0] * (1.0 - raw[1:])   # 1 - s'' with s'' = alpha * s'
  if time_windows == 'uniform':
    edges = np.arange(num_stages + 1) / num_stages
  elif time_windows == 'flow_length':
    edges = np.concatenate([[0.0], np.cumsum(start - end)]) / np.sum(start - end)
  else:
    raise ValueError(f"time_windows must be 'uniform' or 'flow_length', got {time_windows!r}")
  windows = np.stack([edges[:-1], edges[1:]], axis=1)
  return StageFlow(float(gamma), raw, start, end, jumps[:, 0], jumps[:, 1], windows)


def timestep(flow: StageFlow, stage: int, t: Array) -> Array:
  """Local time t [B] of `stage` -> the denoiser's timestep [B] (1000 * global tau)."""
  lo, hi = flow.windows[stage]
  return TIME_SCALE * (lo + t.astype(jnp.float32) * (hi - lo))


def down(x: Array, size: int) -> Array:
  """x [B, H, W, C] -> [B, size, size, C] by 2^k x 2^k averages."""
  return area_resize(x, (size, size))


def up2(x: Array) -> Array:
  """Nearest x2: [B, h, w, C] -> [B, 2h, 2w, C]."""
  return nearest_resize(x, (2 * x.shape[1], 2 * x.shape[2]))


def pyramid_noise(noise: Array, sizes: tuple[int, ...]) -> list[Array]:
  """Full-resolution unit noise [B, H, W, C] -> per-stage unit-variance noise, averaged down."""
  return [down(noise, g) * (noise.shape[1] // g) for g in sizes]


def training_points(flow: StageFlow, sizes: tuple[int, ...], x0: Array, noise: Array, t: Array) -> dict:
  """Per-stage training tensors for data x0 [B, H, W, C], unit noise of the same shape and local
  times t [S, B] in [0, 1]. Returns lists over stages of 'start', 'end', 'x_t' and 'v' (each
  [B, g_s, g_s, C], float32) and 'timestep' [B]."""
  x0, noise = x0.astype(jnp.float32), noise.astype(jnp.float32)
  clean = [down(x0, g) for g in sizes]
  noises = pyramid_noise(noise, sizes)
  out = {k: [] for k in ('start', 'end', 'x_t', 'v', 'timestep')}
  for s in range(flow.num_stages):
    ss, se = flow.start_sigmas[s], flow.end_sigmas[s]
    start = noises[s] if s == 0 else ss * noises[s] + (1 - ss) * up2(clean[s - 1])
    end = se * noises[s] + (1 - se) * clean[s]
    ts = t[s].astype(jnp.float32)[:, None, None, None]
    out['start'].append(start)
    out['end'].append(end)
    out['x_t'].append((1 - ts) * start + ts * end)
    out['v'].append(end - start)
    out['timestep'].append(timestep(flow, s, t[s]))
  return out


@functools.lru_cache(maxsize=None)
def block_noise_factor(gamma: float) -> np.ndarray:
  """[4, 4] L with L L^T = (1 + gamma) I - gamma 11^T. The covariance is singular at gamma = 1/3
  (the block sum has no variance then), so L comes from its eigendecomposition, not Cholesky."""
  cov = (1.0 + gamma) * np.eye(4) - gamma * np.ones((4, 4))
  w, q = np.linalg.eigh(cov)
  if w.min() < -1e-12:
    raise ValueError(f'block noise covariance is not positive semi-definite for gamma={gamma} (> 1/3)')
  return (q * np.sqrt(np.clip(w, 0.0, None))).astype(np.float32)


def block_noise(key: Array, shape: tuple[int, ...], gamma: float) -> Array:
  """[B, H, W, C] (H, W even) of noise i.i.d. over 2x2 blocks, each with the block covariance.
  A block's four values are ordered (row, column) as Pyramid Flow's `(p q)`."""
  b, h, w, c = shape
  z = jax.random.normal(key, (b, h // 2, w // 2, c, 4), jnp.float32)
  n = jnp.einsum('ij,...j->...i', jnp.asarray(block_noise_factor(gamma)), z)
  n = n.reshape(b, h // 2, w // 2, c, 2, 2)
  return n.transpose(0, 1, 4, 2, 5, 3).reshape(b, h, w, c)


def renoise_jump(flow: StageFlow, stage: int, x_end: Array, key: Array) -> Array:
  """The end point of stage - 1, x_end [B, h, w, C] -> a start point of `stage` [B, 2h, 2w, C]."""
  x = up2(x_end.astype(jnp.float32))
  n = block_noise(key, x.shape, flow.gamma)
  return flow.jump_alpha[stage] * x + flow.jump_beta[stage] * n

