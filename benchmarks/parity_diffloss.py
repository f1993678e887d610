"""Parity of our DiffLoss (denoiser, converter, diffusion losses, sampler) with the official MAR code.

  PYTHONPATH=. /work/venvs/torch/bin/python benchmarks/parity_diffloss.py --official /work/official/mar

Needs torch and the JAX stack in one interpreter; the official `models/diffloss.py` and
`diffusion/` are imported from --official at run time. Builds the official DiffLoss
(default MAR-B sizes), re-randomises every parameter (the official init zeroes the adaLN
modulations and the output layer, which would hide them; the scales below keep
activations O(1) so every term matters), converts the state dict, and compares in float32:
  * net forward and forward_with_cfg;
  * training_losses (mse, vb, loss) at given t and noise. The t = 0 rows (decoder NLL) are
    reported apart with their own --nll-tol: there the variance is tiny (1/std up to ~400) and
    the tanh-CDF bin difference cancels, so one float32 ulp in the mean moves the NLL by ~1e-4
    relative (both float32 implementations sit ~1e-1 from a float64 evaluation there);
  * `DiffLoss.sample` end to end (100 respaced steps) with the initial and per-step noises
    injected by replacing torch.randn / torch.randn_like for the duration of the call,
    against `p_sample_loop_with_noises` on the same noises; then the same loop on a net
    nudged toward a denoiser (`toward_denoiser`), where samples stay O(1) and the
    temperature-scaled noise term is a visible part of the result (noise_term_effect: how
    far the sample moves at temperature 0).
Prints one JSON line per check (max |ours - official| / max |official|; for samples also the
worst row, each row normalised by its own max, since untrained nets drive some rows to ~1e5);
exits 1 if a check exceeds its tolerance.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from parity_common import rel_err, report
from var_models.convert.diffloss import convert_diffloss
from var_models.mar.diffloss import DiffLossConfig, SimpleMLPAdaLN, diffloss_model_fn
from var_models.mar.gaussian_diffusion import create_diffusion

jax.config.update('jax_default_matmul_precision', 'highest')


def build_official(official: str, cfg: DiffLossConfig, seed: int):
  if official not in sys.path:
    sys.path.insert(0, official)
  from models.diffloss import DiffLoss  # pylint: disable=import-outside-toplevel
  torch.manual_seed(seed)
  model = DiffLoss(target_channels=cfg.target_channels, z_channels=cfg.z_channels, depth=cfg.depth,
                   width=cfg.width, num_sampling_steps=str(cfg.num_sampling_steps)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 2:     # Linear [out, in]
        p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
      elif name.endswith('in_ln.weight'):
        p.normal_(1.0, 0.1)
      else:               # biases, LayerNorm shifts
        p.normal_(0.0, 0.1)
  return model


@contextlib.contextmanager
def injected_noise(x_half: np.ndarray, noises: np.ndarray):
  """Official sampling on CPU with our noises: torch.randn returns x_half (the initial draw),
  torch.randn_like returns noises[0], noises[1], ... (one per p_sample), .cuda() is a no-op."""
  steps = iter(torch.from_numpy(n) for n in noises)
  saved = torch.randn, torch.randn_like, torch.Tensor.cuda
  torch.randn = lambda *a, **k: torch.from_numpy(x_half)
  torch.randn_like = lambda x, *a, **k: next(steps)
  torch.Tensor.cuda = lambda self, *a, **k: self
  try:
    yield
  finally:
    torch.randn, torch.randn_like, torch.Tensor.cuda = saved
  if next(steps, None) is not None:
    raise RuntimeError('the official loop drew fewer per-step noises than injected')


def check_forward(official, net: SimpleMLPAdaLN, params, cfg: DiffLossConfig, rng, n: int, cfg_scale: float,
                  tol: float):
  x = rng.standard_normal((n, cfg.target_channels)).astype(np.float32)
  t = rng.integers(0, cfg.train_steps, n)
  c = rng.standard_normal((n, cfg.z_channels)).astype(np.float32)
  with torch.no_grad():
    want = official.net(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(c)).numpy()
    want_cfg = official.net.forward_with_cfg(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(c),
                                             cfg_scale).numpy()
  got = net.apply({'params': params}, x, t, c)
  got_cfg = net.apply({'params': params}, x, t, c, cfg_scale, method=SimpleMLPAdaLN.forward_with_cfg)
  return [report(check='forward', rel_err=rel_err(got, want), scale=float(np.abs(want).max()), tol=tol),
          report(check='forward_with_cfg', cfg=cfg_scale, rel_err=rel_err(got_cfg, want_cfg), tol=tol)]


def check_losses(official, net: SimpleMLPAdaLN, params, cfg: DiffLossConfig, rng, n: int, tol: float,
                 nll_tol: float):
  x0 = rng.standard_normal((n, cfg.target_channels)).astype(np.float32)
  noise = rng.standard_normal((n, cfg.target_channels)).astype(np.float32)
  t = rng.integers(0, cfg.train_steps, n)
  t[: n // 4] = 0   # decoder-NLL branch
  c = rng.standard_normal((n, cfg.z_channels)).astype(np.float32)
  with torch.no_grad():
    want = official.train_diffusion.training_losses(official.net, torch.from_numpy(x0), torch.from_numpy(t),
                                                    dict(c=torch.from_numpy(c)), noise=torch.from_numpy(noise))
  ours = cfg.train_diffusion()
  got = ours.training_losses(lambda x, tm: net.apply({'params': params}, x, tm, c), x0, jnp.asarray(t), noise)
  out = []
  for rows, name, row_tol in ((t > 0, 'kl rows', tol), (t == 0, 'decoder-nll rows', nll_tol)):
    for k in ('mse', 'vb', 'loss'):
      want_k = want[k].numpy()[rows]
      out.append(report(check=f'training_losses.{k}', rows=name, rel_err=rel_err(np.asarray(got[k])[rows], want_k),
                        mean=float(want_k.mean()), tol=row_tol))
  return out


def toward_denoiser(out, x, t, sqrt_abar, cat):
  """eps := x + sqrt(abar_t) * eps_net. A random net is no denoiser: at t = 999 (abar ~ 2e-9)
  its x0 guess is off by ~1/sqrt(abar) and samples end at ~1e5, where the per-step noise
  barely registers. This makes eps nearly the true one there, so samples stay O(1)."""
  c = out.shape[1] // 2
  return cat([x + sqrt_abar[t][:, None] * out[:, :c], out[:, c:]])


def check_sample(official, net: SimpleMLPAdaLN, params, cfg: DiffLossConfig, rng, n: int, temperature: float,
                 cfg_scale: float, tol: float, denoiser_like: bool):
  """End to end `DiffLoss.sample` (plain net), or with `denoiser_like` the official
  `p_sample_loop` exactly as `DiffLoss.sample` calls it, on the net wrapped by `toward_denoiser`."""
  guided = cfg_scale != 1.0
  gen = cfg.gen_diffusion()
  half = n // 2 if guided else n
  x_half = rng.standard_normal((half, cfg.target_channels)).astype(np.float32)
  noises = rng.standard_normal((gen.num_timesteps, n, cfg.target_channels)).astype(np.float32)
  z = rng.standard_normal((n, cfg.z_channels)).astype(np.float32)
  x_T = np.concatenate([x_half, x_half]) if guided else x_half
  sqrt_abar = np.sqrt(create_diffusion(None).alphas_cumprod).astype(np.float32)
  with torch.no_grad(), injected_noise(x_half, noises):
    if denoiser_like:
      fn = official.net.forward_with_cfg if guided else official.net.forward
      kwargs = dict(c=torch.from_numpy(z), **(dict(cfg_scale=cfg_scale) if guided else {}))
      model = lambda x, t, **kw: toward_denoiser(fn(x, t, **kw), x, t, torch.from_numpy(sqrt_abar),
                                                   lambda a: torch.cat(a, dim=1))
      want = official.gen_diffusion.p_sample_loop(model, x_T.shape, torch.from_numpy(x_T), clip_denoised=False,
                                                  model_kwargs=kwargs, temperature=temperature)
      want = want.numpy()
    else:
      want = official.sample(torch.from_numpy(z), temperature=temperature, cfg=cfg_scale).numpy()

  def ours(p, z, x_T, noises, temp, s):
    model_fn = diffloss_model_fn(net, p, z, s, guided)
    if denoiser_like:
      inner = model_fn
      model_fn = lambda x, t, i: toward_denoiser(inner(x, t, i), x, t, jnp.asarray(sqrt_abar),
                                                 lambda a: jnp.concatenate(a, axis=1))
    return gen.p_sample_loop_with_noises(model_fn, x_T, noises, temp)

  fn = jax.jit(ours)
  got = np.asarray(fn(params, z, x_T, noises, temperature, cfg_scale), np.float64)[:half]   # the rows MAR keeps
  cold = np.asarray(fn(params, z, x_T, noises, 0.0, cfg_scale), np.float64)[:half]
  want = want[:half].astype(np.float64)
  worst_row = float(np.max(np.abs(got - want).max(1) / np.abs(want).max(1)))
  return report(check='sample', denoiser_like=denoiser_like, steps=gen.num_timesteps, temperature=temperature,
                cfg=cfg_scale, rel_err=rel_err(got, want), worst_row_rel_err=worst_row,
                median_row_scale=float(np.median(np.abs(want).max(1))),
                noise_term_effect=rel_err(cold, got), tol=tol)


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument('--official', required=True, help='root of the official MAR repo (has models/, diffusion/)')
  ap.add_argument('--width', type=int, default=1024)
  ap.add_argument('--depth', type=int, default=6)
  ap.add_argument('--z-channels', type=int, default=768)
  ap.add_argument('--num-sampling-steps', default='100')
  ap.add_argument('--batch', type=int, default=64)
  ap.add_argument('--seed', type=int, default=0)
  ap.add_argument('--tol', type=float, default=1e-4)
  ap.add_argument('--nll-tol', type=float, default=1e-3, help='for the t = 0 (decoder NLL) loss rows')
  args = ap.parse_args()

  cfg = DiffLossConfig(z_channels=args.z_channels, width=args.width, depth=args.depth,
                       num_sampling_steps=args.num_sampling_steps)
  official = build_official(args.official, cfg, args.seed)
  state = {f'diffloss.{k}': v.detach().numpy() for k, v in official.state_dict().items()}
  params = convert_diffloss(state, cfg)
  net = cfg.make_net()
  rng = np.random.default_rng(args.seed)
  results = check_forward(official, net, params, cfg, rng, args.batch, 3.0, args.tol)
  results += check_losses(official, net, params, cfg, rng, args.batch, args.tol, args.nll_tol)
  for denoiser_like in (False, True):
    for temperature, cfg_scale in ((1.0, 3.0), (0.95, 3.0), (1.0, 1.0)):
      results.append(check_sample(official, net, params, cfg, rng, args.batch, temperature, cfg_scale, args.tol,
                                  denoiser_like))
  failed = [r for r in results if r['rel_err'] > r['tol']]
  report(check='summary', failed=len(failed), ok=not failed)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
