"""Gaussian diffusion for MAR's DiffLoss head, as the official (DiT/IDDPM-derived) code computes it.

Configuration fixed to what MAR uses: epsilon prediction, LEARNED_RANGE variance, loss
MSE + VB with the mean frozen in the VB term, no x0 clipping, no timestep rescaling.

Schedules are computed in float64 NumPy and cast to float32 after indexing, as the
official `_extract_into_tensor` does, so the float32 arithmetic afterwards matches.
A respaced process (`create_diffusion('100')`) keeps a subset of the original steps:
its betas are recomputed from alphas_cumprod at the kept steps, indices `t` run over
the kept steps, and the model is called with the original step `timestep_map[t]`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Hashable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
# model_fn(x [N, C], t_model [N] int, i: loop step) -> [N, 2C] (eps, variance values)
SampleModelFn = Callable[[Array, Array, Array], Array]


def cosine_betas(num_steps: int, max_beta: float = 0.999) -> np.ndarray:
  """IDDPM cosine schedule [T] float64: beta_i = 1 - abar((i+1)/T) / abar(i/T), clipped."""
  abar = lambda s: math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
  return np.array([min(1 - abar((i + 1) / num_steps) / abar(i / num_steps), max_beta)
                   for i in range(num_steps)], dtype=np.float64)


def linear_betas(num_steps: int) -> np.ndarray:
  """DDPM linear schedule [T] float64, scaled so any T matches the 1000-step endpoints."""
  scale = 1000 / num_steps
  return np.linspace(scale * 1e-4, scale * 0.02, num_steps, dtype=np.float64)


def space_timesteps(num_steps: int, section_counts: Union[str, int, list[int]]) -> list[int]:
  """Sorted original steps to keep: `section_counts` ('100', '10,20', 100, [10, 20]) splits
  the T steps into equal sections, each strided (fractional stride, rounded) to its count.
  'ddimN' takes the integer stride giving exactly N steps."""
  if isinstance(section_counts, str) and section_counts.startswith('ddim'):
    want = int(section_counts[len('ddim'):])
    for stride in range(1, num_steps):
      if len(range(0, num_steps, stride)) == want:
        return list(range(0, num_steps, stride))
    raise ValueError(f'cannot take exactly {want} of {num_steps} steps with an integer stride')
  if isinstance(section_counts, str):
    section_counts = [int(s) for s in section_counts.split(',')]
  elif isinstance(section_counts, int):
    section_counts = [section_counts]
  size_per, extra = divmod(num_steps, len(section_counts))
  steps, start = [], 0
  for i, count in enumerate(section_counts):
    size = size_per + (1 if i < extra else 0)
    if size < count:
      raise ValueError(f'cannot divide a section of {size} steps into {count}')
    stride = 1 if count <= 1 else (size - 1) / (count - 1)
    # Python's round (half to even) on the accumulated float, as the official loop does.
    cur = 0.0
    for _ in range(count):
      steps.append(start + round(cur))
      cur += stride
    start += size
  return sorted(set(steps))


class MeanVar(NamedTuple):
  """p(x_{t-1} | x_t): all [N, C] float32."""
  mean: Array
  variance: Array
  log_variance: Array
  pred_xstart: Array


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashable by identity, usable as a static arg
class GaussianDiffusion:
  """Schedule arrays ([T] float64 NumPy) of a (possibly respaced) process plus its maps."""
  betas: np.ndarray
  timestep_map: np.ndarray  # [T] int64: original step the model sees for index t
  alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  alphas_cumprod_prev: np.ndarray = dataclasses.field(init=False)
  sqrt_alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  sqrt_one_minus_alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  sqrt_recip_alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  sqrt_recipm1_alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  posterior_variance: np.ndarray = dataclasses.field(init=False)
  posterior_log_variance_clipped: np.ndarray = dataclasses.field(init=False)
  posterior_mean_coef1: np.ndarray = dataclasses.field(init=False)
  posterior_mean_coef2: np.ndarray = dataclasses.field(init=False)
  log_betas: np.ndarray = dataclasses.field(init=False)

  def __post_init__(self):
    b = np.asarray(self.betas, np.float64)
    if b.ndim != 1 or b.shape[0] < 2 or not ((b > 0) & (b <= 1)).all():
      raise ValueError(f'betas must be 1-D with >= 2 entries in (0, 1], got shape {b.shape}')
    if np.shape(self.timestep_map) != b.shape:
      raise ValueError(f'timestep_map shape {np.shape(self.timestep_map)} != betas shape {b.shape}')
    ac = np.cumprod(1.0 - b)
    ac_prev = np.append(1.0, ac[:-1])
    post_var = b * (1.0 - ac_prev) / (1.0 - ac)
    derived = dict(
        betas=b, timestep_map=np.asarray(self.timestep_map, np.int64),
        alphas_cumprod=ac, alphas_cumprod_prev=ac_prev,
        sqrt_alphas_cumprod=np.sqrt(ac), sqrt_one_minus_alphas_cumprod=np.sqrt(1.0 - ac),
        sqrt_recip_alphas_cumprod=np.sqrt(1.0 / ac), sqrt_recipm1_alphas_cumprod=np.sqrt(1.0 / ac - 1),
        posterior_variance=post_var,
        # The posterior variance is 0 at t = 0; its log takes the t = 1 value there.
        posterior_log_variance_clipped=np.log(np.append(post_var[1], post_var[1:])),
        posterior_mean_coef1=b * np.sqrt(ac_prev) / (1.0 - ac),
        posterior_mean_coef2=(1.0 - ac_prev) * np.sqrt(1.0 - b) / (1.0 - ac),
        log_betas=np.log(b))
    for k, v in derived.items():
      object.__setattr__(self, k, v)

  @property
  def num_timesteps(self) -> int:
    return int(self.betas.shape[0])

  def model_timesteps(self, t: Array) -> Array:
    """t [N] indices into this process -> [N] int32 original steps for the model."""
    return jnp.asarray(self.timestep_map, jnp.int32)[t]

  def q_sample(self, x0: Array, t: Array, noise: Array) -> Array:
    """Draw x_t ~ q(x_t | x_0) with the given noise. x0, noise [N, ...]; t [N] -> [N, ...]."""
    return _take(self.sqrt_alphas_cumprod, t, x0) * x0 + _take(self.sqrt_one_minus_alphas_cumprod, t, x0) * noise

  def q_posterior_mean_variance(self, x0: Array, xt: Array, t: Array) -> tuple[Array, Array, Array]:
    """q(x_{t-1} | x_t, x_0) -> (mean, variance, log_variance_clipped), each [N, ...]."""
    mean = _take(self.posterior_mean_coef1, t, xt) * x0 + _take(self.posterior_mean_coef2, t, xt) * xt
    return mean, _take(self.posterior_variance, t, xt), _take(self.posterior_log_variance_clipped, t, xt)

  def p_mean_variance(self, model_output: Array, x: Array, t: Array) -> MeanVar:
    """model_output [N, 2C] = (eps, v) with v in [-1, 1] interpolating the log variance from
    the clipped posterior one (v = -1) to log beta (v = 1); x [N, C]; t [N]."""
    eps, v = jnp.split(model_output, 2, axis=1)
    min_log = _take(self.posterior_log_variance_clipped, t, x)
    max_log = _take(self.log_betas, t, x)
    frac = (v + 1) / 2
    log_var = frac * max_log + (1 - frac) * min_log
    pred_xstart = (_take(self.sqrt_recip_alphas_cumprod, t, x) * x
                   - _take(self.sqrt_recipm1_alphas_cumprod, t, x) * eps)
    mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x, t)
    return MeanVar(mean, jnp.exp(log_var), log_var, pred_xstart)

  def training_losses(self, model_fn: Callable[[Array, Array], Array], x0: Array, t: Array,
                      noise: Array) -> dict[str, Array]:
    """Per-sample {'loss', 'mse', 'vb'} [N]. model_fn(x_t [N, C], t_model [N]) -> [N, 2C];
    t [N] indexes this process's steps. The VB term only trains the variance values."""
    xt = self.q_sample(x0, t, noise)
    out = model_fn(xt, self.model_timesteps(t))
    eps, v = jnp.split(out, 2, axis=1)
    vb = self._vb_bits(jnp.concatenate([jax.lax.stop_gradient(eps), v], axis=1), x0, xt, t)
    mse = _mean_flat((noise - eps) ** 2)
    return {'loss': mse + vb, 'mse': mse, 'vb': vb}

  def _vb_bits(self, model_output: Array, x0: Array, xt: Array, t: Array) -> Array:
    """[N] VLB term in bits: KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t)), and at t == 0 the
    decoder NLL with the official's 1/255-bin discretised Gaussian."""
    true_mean, _, true_log_var = self.q_posterior_mean_variance(x0, xt, t)
    p = self.p_mean_variance(model_output, xt, t)
    kl = _mean_flat(normal_kl(true_mean, true_log_var, p.mean, p.log_variance)) / np.log(2.0)
    nll = -_mean_flat(discretized_gaussian_log_likelihood(x0, p.mean, 0.5 * p.log_variance)) / np.log(2.0)
    return jnp.where(t == 0, nll, kl)

  def p_sample(self, model_output: Array, x: Array, t: Array, noise: Array, temperature) -> Array:
    """One ancestral step x_t -> x_{t-1}; temperature scales only the noise term and t == 0
    adds no noise. model_output [N, 2C]; x, noise [N, C]; t [N]."""
    p = self.p_mean_variance(model_output, x, t)
    nonzero = (t != 0).astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
    return p.mean + nonzero * jnp.exp(0.5 * p.log_variance) * noise * temperature

  def p_sample_loop(self, model_fn: SampleModelFn, noise: Array, key: Array, temperature,
                    step_fn: Optional[Callable] = None) -> Array:
    """Sample from x_T = noise [N, C] over all steps t = T-1 .. 0 -> x_0 [N, C]. Loop step
    i (t = T-1-i) draws its noise from fold_in(key, i). model_fn(x, t_model [N], i) -> [N, 2C].
    step_fn(model_output, x, t, noise, temperature) -> x_{t-1} replaces `p_sample` if given."""
    draw = lambda i: jax.random.normal(jax.random.fold_in(key, i), noise.shape, noise.dtype)
    return self._loop(model_fn, noise, draw, temperature, step_fn)

  def p_sample_loop_with_noises(self, model_fn: SampleModelFn, x_T: Array, noises: Array, temperature,
                                step_fn: Optional[Callable] = None) -> Array:
    """`p_sample_loop` with loop step i using noises[i]; noises [T, N, C] (noises[T-1] is
    multiplied by zero at t == 0 but kept so the count matches the official draws)."""
    if noises.shape != (self.num_timesteps,) + x_T.shape:
      raise ValueError(f'noises shape {noises.shape} != {(self.num_timesteps,) + x_T.shape}')
    return self._loop(model_fn, x_T, lambda i: noises[i], temperature, step_fn)

  def p_sample_loop_stepped(self, kinds: Sequence[Hashable], model_fn, x_T: Array, noise_fn, temperature,
                            state: Any) -> tuple[Array, Any]:
    """The sampling loop with a static kind per loop step i (t = T-1-i) and a state threaded
    through it: model_fn(kind, x, t_model [N], i, state) -> (out [N, 2C], state); noise_fn(i) ->
    [N, C]. Runs of equal kinds, and patterns of runs repeated back to back, are each one
    `fori_loop`, so a periodic schedule traces each kind a few times. -> (x_0 [N, C], state)."""
    if len(kinds) != self.num_timesteps:
      raise ValueError(f'{len(kinds)} step kinds for a {self.num_timesteps}-step process')
    n, steps = x_T.shape[0], self.num_timesteps

    def step(kind, i, carry):
      x, state = carry
      t = jnp.full((n,), steps - 1 - i, jnp.int32)
      out, state = model_fn(kind, x, self.model_timesteps(t), i, state)
      return self.p_sample(out, x, t, noise_fn(i), temperature), state

    def pattern(runs, period, start, r, carry):
      i = start + r * period
      for kind, length in runs:
        one = functools.partial(step, kind)
        # A static trip count (0..length, offset by i) keeps XLA from reading the loop bound back
        # to the host at every step (i is traced inside a folded pattern).
        carry = one(i, carry) if length == 1 else jax.lax.fori_loop(
            0, length, lambda j, c, one=one, i=i: one(i + j, c), carry)
        i = i + length
      return carry

    carry, start = (x_T, state), 0
    for reps, runs in fold_runs(kinds):
      period = sum(length for _, length in runs)
      body = functools.partial(pattern, runs, period, start)
      carry = body(0, carry) if reps == 1 else jax.lax.fori_loop(0, reps, body, carry)
      start += reps * period
    return carry

  def _loop(self, model_fn, x_T, noise_fn, temperature, step_fn):
    step = step_fn or self.p_sample
    n, steps = x_T.shape[0], self.num_timesteps

    def body(i, x):
      t = jnp.full((n,), steps - 1 - i, jnp.int32)
      return step(model_fn(x, self.model_timesteps(t), i), x, t, noise_fn(i), temperature)

    return jax.lax.fori_loop(0, steps, body, x_T)


def fold_runs(kinds: Sequence[Hashable],
              max_period: int = 4) -> list[tuple[int, tuple[tuple[Hashable, int], ...]]]:
  """kinds -> [(repeats, ((kind, run length), ...))]: runs of equal kinds, with up to `max_period`
  runs repeated back to back folded into one pattern (the longest cover wins)."""
  runs: list[tuple[Hashable, int]] = []
  for k in kinds:
    if runs and runs[-1][0] == k:
      runs[-1] = (k, runs[-1][1] + 1)
    else:
      runs.append((k, 1))
  out, p = [], 0
  while p < len(runs):
    best = (1, 1)
    for period in range(1, max_period + 1):
      reps = 1
      while runs[p + reps * period:p + (reps + 1) * period] == runs[p:p + period]:
        reps += 1
      if reps > 1 and reps * period > best[0] * best[1]:
        best = (reps, period)
    out.append((best[0], tuple(runs[p:p + best[1]])))
    p += best[0] * best[1]
  return out


@functools.lru_cache(maxsize=None)
def create_diffusion(respacing: Union[str, int, None] = None, noise_schedule: str = 'cosine',
                     diffusion_steps: int = 1000) -> GaussianDiffusion:
  """The official `create_diffusion(timestep_respacing, noise_schedule)` for MAR's settings.
  respacing None / '' keeps all steps. Cached, so equal arguments give the same object."""
  schedules = {'cosine': cosine_betas, 'linear': linear_betas}
  if noise_schedule not in schedules:
    raise ValueError(f'unknown noise schedule {noise_schedule!r}; expected one of {sorted(schedules)}')
  base = GaussianDiffusion(schedules[noise_schedule](diffusion_steps), np.arange(diffusion_steps))
  keep = space_timesteps(diffusion_steps, diffusion_steps if respacing in (None, '') else respacing)
  if len(keep) < 2:   # the posterior's clipped log-variance reads step 1, as the official's
    raise ValueError(f'diffusion steps (respacing {respacing!r}) must be >= 2, got {len(keep)}')
  # New betas chain the kept alphas_cumprod: 1 - abar[k_j] / abar[k_{j-1}].
  ac = base.alphas_cumprod[keep]
  return GaussianDiffusion(1.0 - ac / np.append(1.0, ac[:-1]), np.asarray(keep))


def normal_kl(mean1: Array, logvar1: Array, mean2: Array, logvar2: Array) -> Array:
  """Elementwise KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) in nats."""
  return 0.5 * (-1.0 + logvar2 - logvar1 + jnp.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * jnp.exp(-logvar2))


def approx_standard_normal_cdf(x: Array) -> Array:
  """The tanh approximation of the standard normal CDF the official uses."""
  return 0.5 * (1.0 + jnp.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def discretized_gaussian_log_likelihood(x: Array, means: Array, log_scales: Array) -> Array:
  """Elementwise log-probability of the bin [x - 1/255, x + 1/255] (open-ended beyond +-0.999)
  under N(means, exp(log_scales)^2), in nats; probabilities floored at 1e-12."""
  inv_std = jnp.exp(-log_scales)
  cdf_plus = approx_standard_normal_cdf(inv_std * (x - means + 1.0 / 255.0))
  cdf_min = approx_standard_normal_cdf(inv_std * (x - means - 1.0 / 255.0))
  log_cdf_plus = jnp.log(jnp.maximum(cdf_plus, 1e-12))
  log_one_minus_cdf_min = jnp.log(jnp.maximum(1.0 - cdf_min, 1e-12))
  log_delta = jnp.log(jnp.maximum(cdf_plus - cdf_min, 1e-12))
  return jnp.where(x < -0.999, log_cdf_plus, jnp.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def _take(arr: np.ndarray, t: Array, x: Array) -> Array:
  """arr[t] cast to float32 and broadcast to x [N, ...]."""
  return jnp.broadcast_to(jnp.asarray(arr, jnp.float32)[t].reshape((-1,) + (1,) * (x.ndim - 1)), x.shape)


def _mean_flat(x: Array) -> Array:
  return jnp.mean(x, axis=tuple(range(1, x.ndim)))
