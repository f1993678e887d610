"""Parity of var_models.nn.resample.resize with torch.nn.functional.interpolate.

Runs every case in float32 on random inputs, prints the max abs error per case
and fails (exit 1) if any exceeds the tolerance.

  PYTHONPATH=. /work/venvs/torch/bin/python benchmarks/parity_resample.py
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from var_models.nn.resample import resize  # noqa: E402

# (method, (h_in, w_in), (h_out, w_out))
CASES = (
    [('area', (n, n), (m, m)) for n, m in [(16, 13), (16, 1), (16, 5), (7, 3), (13, 16)]]
    + [('area', (12, 9), (5, 4))]
    + [('bicubic', (n, n), (m, m)) for n, m in [(1, 16), (2, 16), (3, 16), (13, 16), (16, 16), (16, 8)]]
    + [('bicubic', (12, 9), (5, 14))]
    + [('nearest', (n, n), (m, m)) for n, m in [(3, 7), (2, 16), (16, 5)]]
    + [('nearest', (12, 9), (5, 4))]
    # The VAR multi-scale pyramid: 16x16 feature map down to every scale and back.
    + [('area', (16, 16), (p, p)) for p in (1, 2, 3, 4, 5, 6, 8, 10, 13)]
    + [('bicubic', (p, p), (16, 16)) for p in (1, 2, 3, 4, 5, 6, 8, 10, 13)]
    # VAR 512 pyramid (final 32x32).
    + [('area', (32, 32), (p, p)) for p in (1, 2, 3, 4, 6, 9, 13, 18, 24)]
    + [('bicubic', (p, p), (32, 32)) for p in (1, 2, 3, 4, 6, 9, 13, 18, 24)]
)


def torch_resize(x_nhwc: np.ndarray, hw, method: str) -> np.ndarray:
  t = torch.from_numpy(x_nhwc).permute(0, 3, 1, 2).contiguous()
  kw = {'align_corners': False} if method == 'bicubic' else {}
  y = F.interpolate(t, size=tuple(hw), mode=method, **kw)
  return y.permute(0, 2, 3, 1).numpy()


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument('--tol', type=float, default=1e-5)
  ap.add_argument('--batch', type=int, default=4)
  ap.add_argument('--channels', type=int, default=32)
  ap.add_argument('--seed', type=int, default=0)
  args = ap.parse_args()

  torch.set_num_threads(1)
  rng = np.random.default_rng(args.seed)
  fn = jax.jit(resize, static_argnums=(1, 2))
  print(f'jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}; '
        f'float32, batch {args.batch}, channels {args.channels}, tol {args.tol:g}')
  print(f'{"method":8s} {"in":>7s} -> {"out":<7s} {"max_abs_err":>12s} {"max|ref|":>9s}')
  worst, failures = 0.0, []
  for method, hw_in, hw_out in CASES:
    x = rng.standard_normal((args.batch, *hw_in, args.channels)).astype(np.float32)
    want = torch_resize(x, hw_out, method)
    got = np.asarray(fn(jnp.asarray(x), hw_out, method))
    assert got.shape == want.shape and got.dtype == np.float32, (got.shape, want.shape, got.dtype)
    err = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
    worst = max(worst, err)
    name = f'{method:8s} {hw_in[0]:>3d}x{hw_in[1]:<3d} -> {hw_out[0]:>3d}x{hw_out[1]:<3d}'
    print(f'{name} {err:12.3e} {np.abs(want).max():9.3f}')
    if not err <= args.tol:
      failures.append((name, err))
  print(f'worst max_abs_err {worst:.3e} over {len(CASES)} cases')
  for name, err in failures:
    print(f'FAIL {name}: {err:.3e} > {args.tol:g}')
  assert not failures, f'{len(failures)} case(s) exceed tol {args.tol:g}'
  return 0


if __name__ == '__main__':
  sys.exit(main())
