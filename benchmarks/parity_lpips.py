"""Parity of var_models.tokenizers.lpips with the official `lpips` package (net 'vgg', version 0.1), float32 on CPU.

  /work/venvs/torch/bin/pip install lpips --no-deps
  PYTHONPATH=. /work/venvs/torch/bin/python benchmarks/parity_lpips.py

Needs torch, torchvision, lpips and the JAX stack in one interpreter. Builds
`lpips.LPIPS(net='vgg', pnet_rand=True)` (a random trunk, so nothing is downloaded),
redraws every parameter, the lin layers included (VGG convs ~ N(0, 2 / fan_in) so
activations stay O(1) through 13 ReLU layers, biases ~ N(0, 0.1^2), lin weights
|N(0, 1)| / C, non-negative like the released ones), splits the state dict into
torchvision's vgg16 layout (net.slice{s}.{n} -> features.{n}) and the lin file's layout,
converts both with `convert_lpips`, and compares the distances [B] for random image
pairs and for near pairs (y = x + 0.05 noise). Prints one JSON line per check
(max |ours - official| / max |official|); exits 1 if one exceeds --tol.
"""
from __future__ import annotations

import argparse
import math
import re
import sys

import jax
import numpy as np
import torch

from parity_common import rel_err, report
from var_models.convert.lpips import convert_lpips
from var_models.tokenizers.lpips import LPIPS

jax.config.update('jax_default_matmul_precision', 'highest')


def build_official(seed: int):
  import lpips  # pylint: disable=import-outside-toplevel
  model = lpips.LPIPS(net='vgg', version='0.1', pnet_rand=True, verbose=False).eval()
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if name.startswith('lin'):
        p.copy_(noise.abs() / p.shape[1])
      elif p.ndim == 4:
        p.copy_(noise * math.sqrt(2.0 / p[0].numel()))
      else:
        p.copy_(0.1 * noise)
  return model


def split_state_dict(model) -> tuple[dict, dict]:
  """The official module's state dict -> (torchvision vgg16 layout, lpips lin-file layout)."""
  vgg, lin = {}, {}
  for k, v in model.state_dict().items():
    trunk = re.fullmatch(r'net\.slice\d\.(\d+\.(?:weight|bias))', k)
    if trunk:
      vgg[f'features.{trunk.group(1)}'] = v.numpy()
    elif re.fullmatch(r'lin\d\.model\.1\.weight', k):
      lin[k] = v.numpy()
  return vgg, lin


def check(official, params, name: str, x: np.ndarray, y: np.ndarray, tol: float) -> bool:
  nchw = lambda a: torch.from_numpy(a.transpose(0, 3, 1, 2).copy())
  with torch.no_grad():
    want = official(nchw(x), nchw(y)).numpy().reshape(-1)
  got = np.asarray(jax.jit(lambda p, a, b: LPIPS().apply({'params': p}, a, b))(params, x, y))
  err = rel_err(got, want)
  report(check=name, shape=list(x.shape), rel_err=err, official=[round(float(v), 6) for v in want],
         ok=err <= tol)
  return err <= tol


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument('--batch', type=int, default=4)
  ap.add_argument('--sizes', default='64,72', help='image sizes (72 has odd sizes after pooling)')
  ap.add_argument('--tol', type=float, default=1e-5)
  ap.add_argument('--seed', type=int, default=0)
  args = ap.parse_args()

  official = build_official(args.seed)
  params = convert_lpips(*split_state_dict(official))
  rng = np.random.default_rng(args.seed)
  ok = True
  for size in (int(s) for s in args.sizes.split(',')):
    x = rng.uniform(-1, 1, (args.batch, size, size, 3)).astype(np.float32)
    y = rng.uniform(-1, 1, x.shape).astype(np.float32)
    near = np.clip(x + 0.05 * rng.standard_normal(x.shape), -1, 1).astype(np.float32)
    ok &= check(official, params, 'random pairs', x, y, args.tol)
    ok &= check(official, params, 'near pairs', x, near, args.tol)
  print('PASS' if ok else 'FAIL')
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
