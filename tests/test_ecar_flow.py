"""E-CAR's multistage flow: Pyramid Flow's constants, the stage endpoints, the renoise jump, block noise."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ecar import flow

SIZES = (4, 8, 16)


def test_sigmas_and_jumps_match_pyramid_flow():
  f = flow.stage_flow(3, 1 / 3)
  np.testing.assert_allclose(f.end_sigmas, [0.667, 0.334, 0.0])
  np.testing.assert_allclose(f.raw_start_sigmas, [1.0, 0.667, 0.334])
  np.testing.assert_allclose(f.start_sigmas, [1.0, 0.800, 0.5007], atol=5e-4)  # the notes' digits
  np.testing.assert_allclose(f.jump_alpha[1:], [0.5999, 0.7496], atol=1e-4)
  np.testing.assert_allclose(f.jump_beta[1:], [0.6930, 0.4337], atol=1e-4)
  exact = flow.stage_flow(3, 1 / 3, num_train_timesteps=0)
  np.testing.assert_allclose(exact.start_sigmas, [1.0, 0.8, 0.5], atol=1e-12)


@pytest.mark.parametrize('stages,gamma', [(3, 1 / 3), (4, 1 / 3), (2, 0.25), (5, 0.2)])
def test_jump_closed_form_preserves_the_marginal(stages, gamma):
  """After the jump from end point sigma_e, the data part is (1 - sigma_start) and the noise, which
  is i.i.d., has variance alpha^2 sigma_e^2 + beta^2 = sigma_start^2 (block noise has unit variance)."""
  f = flow.stage_flow(stages, gamma, num_train_timesteps=0)
  for s in range(1, stages):
    a, b, se, ss = f.jump_alpha[s], f.jump_beta[s], f.end_sigmas[s - 1], f.start_sigmas[s]
    assert se == pytest.approx(f.raw_start_sigmas[s])
    assert a * (1 - se) == pytest.approx(1 - ss)
    assert a ** 2 * se ** 2 + b ** 2 == pytest.approx(ss ** 2)
    # Inside a 2x2 block the upsampled noise is fully correlated; block noise cancels it exactly.
    assert a ** 2 * se ** 2 - gamma * b ** 2 == pytest.approx(0.0, abs=1e-12)


@jax.jit
def _points(t):
  x0 = jax.random.uniform(jax.random.key(0), (2, 16, 16, 3), minval=-1, maxval=1)
  noise = jax.random.normal(jax.random.key(1), x0.shape)
  return x0, noise, flow.training_points(flow.stage_flow(3, 1 / 3), SIZES, x0, noise, t)


def test_stage_endpoints():
  f = flow.stage_flow(3, 1 / 3)
  x0, noise, p = _points(jnp.zeros((3, 2)))
  clean = [flow.down(x0, g) for g in SIZES]
  noises = flow.pyramid_noise(noise, SIZES)
  for s in range(3):
    np.testing.assert_allclose(p['x_t'][s], p['start'][s], atol=1e-6)     # t = 0: the start point
    np.testing.assert_allclose(p['v'][s], p['end'][s] - p['start'][s], atol=1e-6)
    want_end = f.end_sigmas[s] * noises[s] + (1 - f.end_sigmas[s]) * clean[s]
    np.testing.assert_allclose(p['end'][s], want_end, atol=1e-6)
  np.testing.assert_allclose(p['start'][0], noises[0], atol=1e-6)
  np.testing.assert_allclose(p['end'][-1], x0, atol=1e-6)                 # the last stage ends on the data
  want_start = f.start_sigmas[2] * noises[2] + (1 - f.start_sigmas[2]) * flow.up2(clean[1])
  np.testing.assert_allclose(p['start'][2], want_start, atol=1e-6)
  _, _, p1 = _points(jnp.ones((3, 2)))
  for s in range(3):
    np.testing.assert_allclose(p1['x_t'][s], p1['end'][s], atol=1e-6)     # t = 1: the end point
    x = p1['start'][s]
    for _ in range(7):                                                    # Euler with the true velocity
      x = x + p1['v'][s] / 7
    np.testing.assert_allclose(x, p1['end'][s], atol=1e-5)


def test_pyramid_noise_has_unit_variance_at_every_stage():
  noise = jax.random.normal(jax.random.key(2), (64, 32, 32, 4))
  for n in flow.pyramid_noise(noise, (4, 8, 16, 32)):
    assert float(jnp.std(n)) == pytest.approx(1.0, abs=0.03)


def test_time_windows_tile_the_interval():
  for windows in ('uniform', 'flow_length'):
    f = flow.stage_flow(3, 1 / 3, time_windows=windows)
    assert f.windows[0, 0] == 0 and f.windows[-1, 1] == pytest.approx(1.0)
    np.testing.assert_allclose(f.windows[1:, 0], f.windows[:-1, 1])
    t = jnp.array([0.0, 1.0])
    for s in range(2):
      assert float(flow.timestep(f, s, t)[1]) == pytest.approx(float(flow.timestep(f, s + 1, t)[0]))
  lengths = np.diff(flow.stage_flow(3, 1 / 3, time_windows='flow_length').windows, axis=1)[:, 0]
  np.testing.assert_allclose(lengths / lengths.sum(), (f.start_sigmas - f.end_sigmas) /
                             (f.start_sigmas - f.end_sigmas).sum())


@pytest.mark.parametrize('gamma', [1 / 3, 0.2])
def test_block_noise_covariance(gamma):
  n = flow.block_noise(jax.random.key(3), (4096, 8, 8, 2), gamma)  # 131072 blocks: atol ~7 sigma
  blocks = np.asarray(n).reshape(4096, 4, 2, 4, 2, 2).transpose(0, 1, 3, 5, 2, 4).reshape(-1, 4)
  cov = blocks.T @ blocks / len(blocks)
  np.testing.assert_allclose(cov, (1 + gamma) * np.eye(4) - gamma * np.ones((4, 4)), atol=0.03)
  if gamma == 1 / 3:
    assert float(np.abs(blocks.sum(axis=1)).max()) < 1e-5  # singular: the block sum is exactly zero
  # Blocks are independent of each other.
  neighbour = np.asarray(n)[:, 0:-2:2, 0::2] * np.asarray(n)[:, 2::2, 0::2]
  assert abs(float(neighbour.mean())) < 0.03


@pytest.mark.parametrize('gamma', [1 / 3, 0.2])
def test_renoise_jump_empirically_gives_the_next_start_distribution(gamma):
  """The sampler's start of a stage has the training start's marginal for every gamma <= 1/3:
  the upsampled data at 1 - sigma_start plus i.i.d. noise of level sigma_start."""
  f = flow.stage_flow(3, gamma)
  b, g, s = 4096, 4, 1
  clean_low = jnp.linspace(-1, 1, g * g).reshape(1, g, g, 1)
  n_low = jax.random.normal(jax.random.key(4), (b, g, g, 1))
  x_end = f.end_sigmas[s - 1] * n_low + (1 - f.end_sigmas[s - 1]) * clean_low
  x = np.asarray(flow.renoise_jump(f, s, x_end, jax.random.key(5)))
  mean = (1 - f.start_sigmas[s]) * np.asarray(flow.up2(clean_low))[0]
  resid = (x - mean).reshape(b, -1)
  np.testing.assert_allclose(x.mean(0), mean, atol=4 * f.start_sigmas[s] / math.sqrt(b))
  cov = resid.T @ resid / b
  np.testing.assert_allclose(np.diag(cov), f.start_sigmas[s] ** 2, rtol=0.12)
  off = cov - np.diag(np.diag(cov))
  assert float(np.abs(off).max()) < 0.12 * f.start_sigmas[s] ** 2  # i.i.d. pixels, blocks included
