"""Parity of var_models.tokenizers.autoencoder_kl with MAR's official KL-16 AutoencoderKL (PyTorch), float32 on CPU.

Builds the official model from the unpacked repo given by --official, gives every
parameter fresh random values, converts its state dict with
`convert_autoencoder_kl`, and compares the posterior (mean, logvar), the decode
of a given latent and the posterior std. Errors are max|jax - torch| / max|torch|.

  PYTHONPATH=. python benchmarks/parity_autoencoder_kl.py --official /work/official/mar

Needs torch and jax in the same interpreter. Exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from benchmarks.parity_vqvae import Report, nhwc, randomise  # noqa: E402
from var_models.convert.autoencoder_kl import convert_autoencoder_kl  # noqa: E402
from var_models.tokenizers.autoencoder_kl import KL16, AutoencoderKL  # noqa: E402


def load_official(path: str):
  sys.path.insert(0, os.path.abspath(path))
  from models.vae import AutoencoderKL as OfficialAutoencoderKL
  return OfficialAutoencoderKL


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument('--official', required=True, help='unpacked LTH14/mar repository')
  ap.add_argument('--batch', type=int, default=2)
  ap.add_argument('--size', type=int, default=256)
  ap.add_argument('--tol', type=float, default=1e-4)
  ap.add_argument('--seed', type=int, default=0)
  args = ap.parse_args()

  cfg = KL16
  tm = load_official(args.official)(embed_dim=cfg.embed_dim, ch_mult=cfg.ch_mult).eval()
  gen = torch.Generator().manual_seed(args.seed)
  randomise(tm, gen)
  img = torch.rand((args.batch, 3, args.size, args.size), generator=gen) * 2 - 1
  hw = args.size // cfg.downsample
  z = torch.randn((args.batch, cfg.embed_dim, hw, hw), generator=gen)
  with torch.no_grad():
    post = tm.encode(img)
    t = {'mean': post.mean, 'logvar': post.logvar, 'std': post.std, 'dec': tm.decode(z)}

  variables = {'params': convert_autoencoder_kl({k: v.numpy() for k, v in tm.state_dict().items()}, cfg)}
  model = AutoencoderKL(cfg)
  mean, logvar = jax.jit(lambda v, x: model.apply(v, x, method=AutoencoderKL.encode))(variables, nhwc(img))
  dec = jax.jit(lambda v, x: model.apply(v, x, method=AutoencoderKL.decode))(variables, nhwc(z))

  n_params = sum(p.numel() for p in tm.parameters())
  print(f'KL-16 {args.size}px batch={args.batch} ({n_params} params); tol {args.tol}')
  rep = Report(args.tol)
  rep.close('posterior mean', mean, nhwc(t['mean']))
  rep.close('posterior logvar (clamped)', logvar, nhwc(t['logvar']))
  rep.close('posterior std', np.exp(0.5 * np.asarray(logvar)), nhwc(t['std']))
  rep.close('decode(z)', dec, nhwc(t['dec']))
  print('PASS' if rep.ok else 'FAIL')
  return 0 if rep.ok else 1


if __name__ == '__main__':
  sys.exit(main())
