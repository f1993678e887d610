"""MAR's diffusion and DiffLoss head: schedules and respacing against closed forms, the
posterior, learned-range variance, the MSE + VB loss and the sampling loop against float64
NumPy, and the denoiser (through the converter) against a float64 NumPy forward."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from var_models.convert.common import StateDictReader
from var_models.convert.diffloss import convert_diffloss
from var_models.mar.diffloss import (DiffLossConfig, SimpleMLPAdaLN, diffloss_loss, diffloss_sample, init_diffloss,
                                 merged_adaln)
from var_models.mar.gaussian_diffusion import create_diffusion, space_timesteps

T = 1000


def abar_closed(s):
  return np.cos((s + 0.008) / 1.008 * np.pi / 2) ** 2


def ref_steps(counts, total=T):
  """The official section rule, restated: equal sections, fractional stride accumulated, round()."""
  size_per, extra = divmod(total, len(counts))
  out, start = [], 0
  for i, k in enumerate(counts):
    size = size_per + (i < extra)
    stride, cur = (1 if k <= 1 else (size - 1) / (k - 1)), 0.0
    for _ in range(k):
      out.append(start + round(cur))
      cur += stride
    start += size
  return sorted(set(out))


# ---------------------------------------------------------------- schedules


def test_cosine_schedule_matches_closed_form():
  d = create_diffusion(None)
  assert d.num_timesteps == T and np.array_equal(d.timestep_map, np.arange(T))
  s = np.arange(T + 1) / T
  betas = np.minimum(1 - abar_closed(s[1:]) / abar_closed(s[:-1]), 0.999)
  np.testing.assert_allclose(d.alphas_cumprod, np.cumprod(1 - betas), rtol=1e-12)
  # Unclipped steps follow abar(t+1)/abar(0) exactly; only the last beta hits the clip.
  np.testing.assert_allclose(d.alphas_cumprod[:-1], abar_closed(s[1:-1]) / abar_closed(0), rtol=1e-10)
  assert d.betas.max() <= 0.999 + 1e-12 and d.betas[-1] == pytest.approx(0.999)
  assert d.betas[:-1].max() < 0.999


def test_posterior_arrays_match_definitions():
  d = create_diffusion(None)
  ac, b = d.alphas_cumprod, d.betas
  ac_prev = np.concatenate([[1.0], ac[:-1]])
  var = b * (1 - ac_prev) / (1 - ac)
  np.testing.assert_allclose(d.posterior_variance, var, rtol=1e-12)
  assert d.posterior_variance[0] == 0 and (d.posterior_variance[1:] > 0).all()
  np.testing.assert_allclose(d.posterior_log_variance_clipped, np.log(np.r_[var[1], var[1:]]), rtol=1e-12)
  np.testing.assert_allclose(d.posterior_mean_coef1, b * np.sqrt(ac_prev) / (1 - ac), rtol=1e-12)
  np.testing.assert_allclose(d.posterior_mean_coef2, (1 - ac_prev) * np.sqrt(1 - b) / (1 - ac), rtol=1e-12)


def test_linear_schedule_endpoints():
  d = create_diffusion(None, 'linear', 500)
  assert d.betas[0] == pytest.approx(2e-4) and d.betas[-1] == pytest.approx(0.04)


# ---------------------------------------------------------------- respacing


@pytest.mark.parametrize('spec,counts', [('100', [100]), ('25', [25]), ('10', [10]), (7, [7]),
                                         ('10,20', [10, 20]), ('3,4,5', [3, 4, 5])])
def test_space_timesteps_rule(spec, counts):
  assert space_timesteps(T, spec) == ref_steps(counts)


def test_space_timesteps_known_maps():
  m100 = create_diffusion('100').timestep_map
  assert len(m100) == 100 and list(m100[:4]) == [0, 10, 20, 30] and list(m100[-3:]) == [979, 989, 999]
  assert list(create_diffusion('10').timestep_map) == list(range(0, 1000, 111))
  assert space_timesteps(T, 'ddim10') == list(range(0, 1000, 100))
  with pytest.raises(ValueError, match='cannot divide'):
    space_timesteps(10, '11')


def test_respaced_process_keeps_alphas_cumprod():
  base = create_diffusion(None)
  for spec in ('100', '25', '10,20'):
    d = create_diffusion(spec)
    np.testing.assert_allclose(d.alphas_cumprod, base.alphas_cumprod[d.timestep_map], rtol=1e-10)
    ac_prev = np.r_[1.0, d.alphas_cumprod[:-1]]
    np.testing.assert_allclose(d.betas, 1 - d.alphas_cumprod / ac_prev, rtol=1e-12)
  assert create_diffusion('100') is create_diffusion('100')  # cached: one static object per spec


def test_a_respacing_of_one_step_is_an_error_naming_the_steps():
  with pytest.raises(ValueError, match=r"diffusion steps \(respacing '1'\) must be >= 2, got 1"):
    create_diffusion('1')


# ---------------------------------------------------------------- q and posterior


def test_q_sample_marginal_moments():
  d = create_diffusion('100')
  x0 = jnp.array([[1.5, -0.5, 0.0]])
  t = jnp.array([37])
  noise = jax.random.normal(jax.random.key(0), (20000, 3))
  xt = d.q_sample(jnp.broadcast_to(x0, noise.shape), jnp.full((20000,), 37), noise)
  ac = d.alphas_cumprod[37]
  np.testing.assert_allclose(xt.mean(0), np.sqrt(ac) * np.asarray(x0[0]), atol=0.03)
  np.testing.assert_allclose(xt.var(0), np.full(3, 1 - ac), rtol=0.05)
  assert d.q_sample(x0, t, jnp.zeros_like(x0)).shape == x0.shape


def test_posterior_is_bayes_rule():
  """q(x_{t-1}|x_t,x_0) from q(x_{t-1}|x_0) = N(sqrt(ab') x0, 1-ab') and q(x_t|x_{t-1}) = N(sqrt(a) x, b)."""
  d = create_diffusion('25')
  rng = np.random.default_rng(0)
  t = np.array([1, 5, 12, 24])
  x0, xt = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
  mean, var, log_var = d.q_posterior_mean_variance(jnp.asarray(x0, jnp.float32), jnp.asarray(xt, jnp.float32),
                                                   jnp.asarray(t))
  ab_prev, b = d.alphas_cumprod[t - 1][:, None], d.betas[t][:, None]
  prec = 1 / (1 - ab_prev) + (1 - b) / b
  want_mean = (np.sqrt(ab_prev) * x0 / (1 - ab_prev) + np.sqrt(1 - b) * xt / b) / prec
  np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(var, np.broadcast_to(1 / prec, (4, 3)), rtol=1e-5)
  np.testing.assert_allclose(log_var, np.log(np.broadcast_to(1 / prec, (4, 3))), rtol=1e-5)


def test_learned_range_interpolates_log_variance():
  d = create_diffusion('100')
  t = jnp.array([0, 1, 50, 99])
  x = jax.random.normal(jax.random.key(1), (4, 3))
  lo, hi = d.posterior_log_variance_clipped[np.asarray(t)], np.log(d.betas[np.asarray(t)])
  for v, want in ((-1.0, lo), (1.0, hi), (0.0, (lo + hi) / 2), (0.5, 0.75 * hi + 0.25 * lo)):
    out = jnp.concatenate([jnp.zeros_like(x), jnp.full_like(x, v)], axis=1)
    p = d.p_mean_variance(out, x, t)
    np.testing.assert_allclose(p.log_variance, np.broadcast_to(want[:, None], (4, 3)), rtol=1e-5)
    np.testing.assert_allclose(p.variance, np.exp(p.log_variance), rtol=1e-6)


def test_true_noise_recovers_x0():
  d = create_diffusion('100')
  x0 = jax.random.normal(jax.random.key(2), (5, 4))
  noise = jax.random.normal(jax.random.key(3), (5, 4))
  t = jnp.array([0, 3, 40, 80, 99])
  xt = d.q_sample(x0, t, noise)
  p = d.p_mean_variance(jnp.concatenate([noise, jnp.zeros_like(noise)], 1), xt, t)
  np.testing.assert_allclose(p.pred_xstart[:4], x0[:4], atol=1e-4)  # t = 99: x_t is nearly all noise
  np.testing.assert_allclose(p.mean, d.q_posterior_mean_variance(x0, xt, t)[0], atol=1e-3)


# ---------------------------------------------------------------- training loss


def ref_vb_bits(d, model_out, x0, noise, t):
  """Float64 NumPy VB term: Gaussian KL in bits for t > 0, 1/255-bin tanh-CDF decoder NLL at t = 0."""
  ab, b = d.alphas_cumprod[t][:, None], d.betas[t][:, None]
  ab_prev = np.r_[1.0, d.alphas_cumprod[:-1]][t][:, None]
  xt = np.sqrt(ab) * x0 + np.sqrt(1 - ab) * noise
  eps, v = np.split(model_out.astype(np.float64), 2, axis=1)
  post_var = d.betas * (1 - np.r_[1.0, d.alphas_cumprod[:-1]]) / (1 - d.alphas_cumprod)
  lo = np.log(np.r_[post_var[1], post_var[1:]])[t][:, None]
  log_var = (v + 1) / 2 * np.log(b) + (1 - v) / 2 * lo
  c1, c2 = b * np.sqrt(ab_prev) / (1 - ab), (1 - ab_prev) * np.sqrt(1 - b) / (1 - ab)
  mean = c1 * (xt / np.sqrt(ab) - np.sqrt(1 / ab - 1) * eps) + c2 * xt
  true_mean = c1 * x0 + c2 * xt
  kl = 0.5 * (-1 + log_var - lo + np.exp(lo - log_var) + (true_mean - mean) ** 2 / np.exp(log_var))
  cdf = lambda z: 0.5 * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
  s = np.exp(0.5 * log_var)
  hi, lo_ = cdf((x0 - mean + 1 / 255) / s), cdf((x0 - mean - 1 / 255) / s)
  logp = np.where(x0 < -0.999, np.log(np.maximum(hi, 1e-12)),
                  np.where(x0 > 0.999, np.log(np.maximum(1 - lo_, 1e-12)), np.log(np.maximum(hi - lo_, 1e-12))))
  return np.where(t == 0, -logp.mean(1), kl.mean(1)) / math.log(2)


def test_training_losses_against_numpy():
  d = create_diffusion(None)
  rng = np.random.default_rng(0)
  t = np.array([0, 0, 0, 1, 300, 999])
  x0 = rng.standard_normal((6, 4)).astype(np.float32)
  x0[0] = [1.5, -1.5, 0.2, -0.3]   # both open-ended decoder bins
  noise = rng.standard_normal((6, 4)).astype(np.float32)
  # eps near the true noise keeps the t = 0 decoder NLL well conditioned in float32
  out = np.concatenate([noise + 0.05 * rng.standard_normal((6, 4)), rng.uniform(-1, 1, (6, 4))], 1)
  out = out.astype(np.float32)
  seen = []
  model_fn = lambda x, tm: (seen.append(np.asarray(tm)), jnp.asarray(out))[1]
  got = d.training_losses(model_fn, jnp.asarray(x0), jnp.asarray(t), jnp.asarray(noise))
  np.testing.assert_array_equal(seen[0], t)
  np.testing.assert_allclose(got['mse'], ((noise - out[:, :4]) ** 2).mean(1), rtol=1e-5)
  np.testing.assert_allclose(got['vb'], ref_vb_bits(d, out, x0, noise, t), rtol=2e-4, atol=1e-6)
  np.testing.assert_allclose(got['loss'], got['mse'] + got['vb'], rtol=1e-6)


def test_training_losses_model_sees_original_steps_and_perfect_eps_has_zero_mse():
  d = create_diffusion('25')
  x0 = jax.random.normal(jax.random.key(0), (4, 3))
  noise = jax.random.normal(jax.random.key(1), (4, 3))
  t = jnp.array([0, 1, 10, 24])
  seen = []
  model_fn = lambda x, tm: (seen.append(np.asarray(tm)), jnp.concatenate([noise, jnp.zeros_like(noise)], 1))[1]
  got = d.training_losses(model_fn, x0, t, noise)
  np.testing.assert_array_equal(seen[0], d.timestep_map[np.asarray(t)])
  np.testing.assert_allclose(got['mse'], 0.0, atol=1e-12)


def test_vb_trains_only_variance_and_mse_only_eps():
  d = create_diffusion(None)
  x0 = jax.random.normal(jax.random.key(0), (3, 4))
  noise = jax.random.normal(jax.random.key(1), (3, 4))
  out = jax.random.normal(jax.random.key(2), (3, 8)) * 0.5
  t = jnp.array([0, 5, 500])
  grads = jax.jit(jax.jacrev(lambda o: d.training_losses(lambda x, tm: o, x0, t, noise)))(out)
  g_vb, g_mse = grads['vb'].sum(0), grads['mse'].sum(0)
  assert np.all(g_vb[:, :4] == 0) and np.abs(g_vb[:, 4:]).max() > 0
  assert np.all(g_mse[:, 4:] == 0) and np.abs(g_mse[:, :4]).max() > 0


# ---------------------------------------------------------------- sampling


def toy_model(x, tm, i):
  """Depends on x, the model's step value and the loop index, so a wrong one shows."""
  eps = 0.5 * jnp.tanh(x) + tm[:, None] / 1000.0 - 0.01 * i
  return jnp.concatenate([eps, jnp.full_like(x, 0.3) - 0.05 * i], axis=1)


def ref_loop(d, x_T, noises, temperature):
  """Float64 ancestral sampling with the toy model, from alphas_cumprod alone."""
  ac = d.alphas_cumprod
  ac_prev = np.r_[1.0, ac[:-1]]
  b = 1 - ac / ac_prev
  post_var = b * (1 - ac_prev) / (1 - ac)
  lo = np.log(np.r_[post_var[1], post_var[1:]])
  x = x_T.astype(np.float64)
  for i, t in enumerate(range(d.num_timesteps - 1, -1, -1)):
    eps = 0.5 * np.tanh(x) + d.timestep_map[t] / 1000.0 - 0.01 * i
    v = 0.3 - 0.05 * i
    log_var = (v + 1) / 2 * np.log(b[t]) + (1 - v) / 2 * lo[t]
    x0 = x / np.sqrt(ac[t]) - np.sqrt(1 / ac[t] - 1) * eps
    mean = (b[t] * np.sqrt(ac_prev[t]) * x0 + (1 - ac_prev[t]) * np.sqrt(1 - b[t]) * x) / (1 - ac[t])
    x = mean + (t > 0) * np.exp(0.5 * log_var) * noises[i] * temperature
  return x


@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_p_sample_loop_with_noises_matches_numpy(temperature):
  d = create_diffusion('10')
  rng = np.random.default_rng(0)
  x_T = rng.standard_normal((3, 4)).astype(np.float32)
  noises = rng.standard_normal((10, 3, 4)).astype(np.float32)
  got = d.p_sample_loop_with_noises(toy_model, jnp.asarray(x_T), jnp.asarray(noises), temperature)
  np.testing.assert_allclose(got, ref_loop(d, x_T, noises, temperature), rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match='noises shape'):
    d.p_sample_loop_with_noises(toy_model, jnp.asarray(x_T), jnp.asarray(noises[:9]), temperature)


def test_temperature_scales_only_the_noise_term():
  d = create_diffusion('100')
  x = jax.random.normal(jax.random.key(0), (4, 3))
  noise = jax.random.normal(jax.random.key(1), (4, 3))
  out = jax.random.normal(jax.random.key(2), (4, 6)) * 0.5
  t = jnp.array([0, 1, 50, 99])
  mean = d.p_mean_variance(out, x, t).mean
  s0, s1, s2 = (d.p_sample(out, x, t, noise, temp) for temp in (0.0, 1.0, 2.5))
  np.testing.assert_allclose(s0, mean, rtol=1e-6)
  np.testing.assert_allclose(s2 - mean, 2.5 * (s1 - mean), rtol=1e-4, atol=1e-6)
  np.testing.assert_array_equal(s1[0], mean[0])   # no noise at t = 0
  assert np.abs(np.asarray(s1 - mean)[1:]).min() > 0


def test_p_sample_loop_draws_fold_in_noise_and_step_fn_hook():
  d = create_diffusion('10')
  key = jax.random.key(7)
  x_T = jax.random.normal(jax.random.key(8), (2, 4))
  noises = jnp.stack([jax.random.normal(jax.random.fold_in(key, i), x_T.shape) for i in range(10)])
  got = jax.jit(lambda k, temp: d.p_sample_loop(toy_model, x_T, k, temp))(key, 0.9)
  np.testing.assert_allclose(got, d.p_sample_loop_with_noises(toy_model, x_T, noises, 0.9), rtol=1e-6)
  cold = lambda out, x, t, noise, temp: d.p_sample(out, x, t, noise, 0.0)
  np.testing.assert_allclose(d.p_sample_loop(toy_model, x_T, key, 1.0, step_fn=cold),
                             d.p_sample_loop(toy_model, x_T, jax.random.key(99), 0.0), rtol=1e-6)


# ---------------------------------------------------------------- DiffLoss net

CFG = DiffLossConfig(z_channels=8, width=32, depth=2, target_channels=4, num_sampling_steps='10')


def official_state_dict(cfg: DiffLossConfig, seed: int = 0, prefix: str = 'diffloss.net.') -> dict:
  """Random official-layout weights (torch Linear [out, in]); O(1) activations throughout."""
  rng = np.random.default_rng(seed)
  w, c = cfg.width, cfg.target_channels
  lin = {'input_proj': (w, c), 'cond_embed': (w, cfg.z_channels), 'time_embed.mlp.0': (w, 256),
         'time_embed.mlp.2': (w, w), 'final_layer.adaLN_modulation.1': (2 * w, w), 'final_layer.linear': (2 * c, w)}
  for i in range(cfg.depth):
    lin.update({f'res_blocks.{i}.mlp.0': (w, w), f'res_blocks.{i}.mlp.2': (w, w),
                f'res_blocks.{i}.adaLN_modulation.1': (3 * w, w)})
  sd = {}
  for k, (o, n) in lin.items():
    sd[f'{prefix}{k}.weight'] = rng.standard_normal((o, n)) / math.sqrt(n)
    sd[f'{prefix}{k}.bias'] = 0.1 * rng.standard_normal(o)
  for i in range(cfg.depth):
    sd[f'{prefix}res_blocks.{i}.in_ln.weight'] = 1 + 0.1 * rng.standard_normal(w)
    sd[f'{prefix}res_blocks.{i}.in_ln.bias'] = 0.1 * rng.standard_normal(w)
  return {k: v.astype(np.float32) for k, v in sd.items()}


def ref_net(sd: dict, cfg: DiffLossConfig, x, t, c, prefix='diffloss.net.'):
  """Official SimpleMLPAdaLN.forward in float64 NumPy."""
  lin = lambda k, h: h @ sd[prefix + k + '.weight'].astype(np.float64).T + sd[prefix + k + '.bias']
  silu = lambda h: h / (1 + np.exp(-h))
  ln = lambda h: (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-6)
  freqs = np.exp(-math.log(10000) * np.arange(128) / 128)
  args = np.asarray(t, np.float64)[:, None] * freqs
  y = lin('time_embed.mlp.2', silu(lin('time_embed.mlp.0', np.concatenate([np.cos(args), np.sin(args)], 1))))
  y = y + lin('cond_embed', c)
  h = lin('input_proj', x)
  for i in range(cfg.depth):
    b = f'res_blocks.{i}.'
    shift, scale, gate = np.split(lin(b + 'adaLN_modulation.1', silu(y)), 3, axis=1)
    hn = ln(h) * sd[prefix + b + 'in_ln.weight'] + sd[prefix + b + 'in_ln.bias']
    h = h + gate * lin(b + 'mlp.2', silu(lin(b + 'mlp.0', hn * (1 + scale) + shift)))
  shift, scale = np.split(lin('final_layer.adaLN_modulation.1', silu(y)), 2, axis=1)
  return lin('final_layer.linear', ln(h) * (1 + scale) + shift)


@pytest.fixture(scope='module')
def converted():
  sd = official_state_dict(CFG)
  return sd, convert_diffloss(sd, CFG)


def test_net_matches_numpy_forward(converted):
  sd, params = converted
  rng = np.random.default_rng(1)
  x, c = rng.standard_normal((6, 4)), rng.standard_normal((6, 8))
  t = np.array([0, 1, 10, 500, 990, 999])
  got = CFG.make_net().apply({'params': params}, jnp.asarray(x, jnp.float32), jnp.asarray(t), jnp.asarray(c, jnp.float32))
  want = ref_net(sd, CFG, x, t, c)
  assert got.shape == (6, 8) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_merged_adaln_gemm_equals_the_per_block_linears(converted):
  _, params = converted
  rng = np.random.default_rng(3)
  x, c = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((6, 8)).astype(np.float32)
  t = np.array([0, 1, 10, 500, 990, 999])
  net = CFG.make_net()
  kernel, bias = merged_adaln(params)
  assert kernel.shape == (CFG.width, (3 * CFG.depth + 2) * CFG.width) and bias.shape == kernel.shape[1:]
  np.testing.assert_allclose(net.apply({'params': params}, x, t, c, (kernel, bias)),
                             net.apply({'params': params}, x, t, c), rtol=1e-6, atol=1e-6)


def test_forward_with_cfg_semantics(converted):
  sd, params = converted
  rng = np.random.default_rng(2)
  x, c = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((6, 8)).astype(np.float32)
  t = np.array([5, 5, 5, 5, 5, 5])
  net = CFG.make_net()
  got = net.apply({'params': params}, x, t, c, 3.0, method=SimpleMLPAdaLN.forward_with_cfg)
  full = ref_net(sd, CFG, np.concatenate([x[:3], x[:3]]), t, c)
  eps_c, eps_u = full[:3, :4], full[3:, :4]
  guided = eps_u + 3.0 * (eps_c - eps_u)
  want = np.concatenate([np.concatenate([guided, guided]), full[:, 4:]], 1)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  x2 = x.copy()
  x2[3:] += 1.0   # the uncond half's inputs are ignored
  np.testing.assert_array_equal(got, net.apply({'params': params}, x2, t, c, 3.0,
                                               method=SimpleMLPAdaLN.forward_with_cfg))


def test_official_init():
  p = jax.jit(init_diffloss, static_argnums=0)(DiffLossConfig(z_channels=8, width=64, depth=2), jax.random.key(0))
  zero = [p['final_layer']['linear'], p['final_layer']['adaLN_modulation_1'],
          p['res_blocks_0']['adaLN_modulation_1'], p['res_blocks_1']['adaLN_modulation_1']]
  assert all(np.all(np.asarray(leaf) == 0) for q in zero for leaf in q.values())
  k = np.asarray(p['input_proj']['kernel'])
  assert np.abs(k).max() <= math.sqrt(6 / (16 + 64)) and np.all(np.asarray(p['input_proj']['bias']) == 0)
  assert np.asarray(p['time_embed']['mlp_0']['kernel']).std() == pytest.approx(0.02, rel=0.05)
  assert np.all(np.asarray(p['res_blocks_0']['in_ln']['scale']) == 1)


def test_converter_errors_name_the_key():
  sd = official_state_dict(CFG)
  missing = {k: v for k, v in sd.items() if k != 'diffloss.net.res_blocks.1.mlp.2.bias'}
  with pytest.raises(ValueError, match=r'res_blocks\.1\.mlp\.2\.bias'):
    convert_diffloss(missing, CFG)
  bad = {**sd, 'diffloss.net.final_layer.linear.weight': np.zeros((8, 31), np.float32)}
  with pytest.raises(ValueError, match=r'final_layer\.linear\.weight'):
    convert_diffloss(bad, CFG)
  extra = {**sd, 'diffloss.net.final_layer.norm_final.weight': np.ones(32, np.float32)}
  with pytest.raises(ValueError, match=r'norm_final\.weight'):
    convert_diffloss(extra, CFG)
  # With a shared reader the caller owns finish(): other keys are left for it to consume.
  reader = StateDictReader({**sd, 'other.weight': np.zeros(3)})
  convert_diffloss(reader, CFG)
  with pytest.raises(ValueError, match='other.weight'):
    reader.finish()


# ---------------------------------------------------------------- loss and sampling wrappers


def test_diffloss_loss_mask(converted):
  _, params = converted
  net = CFG.make_net()
  rng = np.random.default_rng(3)
  target, z = rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
  loss = lambda tg, m: float(jax.jit(diffloss_loss, static_argnums=0)(net, params, tg, z, m, jax.random.key(0)))
  assert loss(target, None) == pytest.approx(loss(target, np.ones(8)), rel=1e-6)
  mask = np.array([1, 0, 1, 1, 0, 0, 1, 0], np.float32)
  changed = target.copy()
  changed[mask == 0] += 5.0   # masked-out rows do not count
  assert loss(target, mask) == pytest.approx(loss(changed, mask), rel=1e-6)
  assert loss(target, mask) != pytest.approx(loss(changed, None), rel=1e-3)


def test_diffloss_sample_guided_shares_noise(converted):
  _, params = converted
  net, d = CFG.make_net(), CFG.gen_diffusion()
  rng = np.random.default_rng(4)
  z = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
  sample = jax.jit(lambda z, k, temp, s, guided: diffloss_sample(net, params, z, k, temp, s, guided=guided,
                                                                 diffusion=d), static_argnums=4)
  key = jax.random.key(5)
  guided = sample(z, key, 1.0, jnp.float32(2.0), True)
  assert guided.shape == (6, 4) and np.isfinite(np.asarray(guided)).all()
  # At temperature 0 and scale 1, the cond half is plain sampling of the cond rows from the same x_T
  # (other noise would change every value; float32 GEMMs of 6 and 3 rows, summed in other orders,
  # differ by ~2e-5 of values grown to 1e4 by the random net).
  np.testing.assert_allclose(sample(z, key, 0.0, jnp.float32(1.0), True)[:3],
                             sample(z[:3], key, 0.0, jnp.float32(1.0), False), rtol=1e-4, atol=1e-4)
