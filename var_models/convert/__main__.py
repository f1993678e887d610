"""Converts official checkpoints into an orbax checkpoint directory; see the package docstring."""
from __future__ import annotations

import argparse
import sys

import numpy as np

from var_models import checkpoint
from var_models.convert.autoencoder_kl import convert_autoencoder_kl
from var_models.convert.common import strip_prefix
from var_models.convert.diffusers_vae import convert_diffusers_vae
from var_models.convert.inception import convert_inception
from var_models.convert.lpips import convert_lpips
from var_models.convert.mar import convert_mar
from var_models.convert.var import convert_var, infer_var_depth
from var_models.convert.vqvae import convert_vqvae
from var_models.mar import model as mar_lib
from var_models.tokenizers.autoencoder_kl import KL16, SDXL_F8C4
from var_models.tokenizers.vqvae import VQVAEConfig
from var_models.var.model import VARConfig

MAR_SIZES = {'base': mar_lib.base, 'large': mar_lib.large, 'huge': mar_lib.huge}
_WRAPPERS = ('state_dict', 'model', 'trainer')


def load_state_dict(path: str, entries: tuple[str, ...] = _WRAPPERS) -> dict[str, np.ndarray]:
  """A state dict as NumPy arrays from .pth/.pt/.ckpt (PyTorch), .npz or .safetensors.

  A training checkpoint's state dict is taken from the first of `entries` it holds.
  """
  if path.endswith('.npz'):
    with np.load(path) as f:
      return strip_prefix({k: f[k] for k in f.files}, 'module.')
  if path.endswith('.safetensors'):
    from safetensors.numpy import load_file
    return strip_prefix(load_file(path), 'module.')
  return _load_torch(path, entries)


def _load_torch(path: str, entries: tuple[str, ...]) -> dict[str, np.ndarray]:
  try:
    import torch
  except ImportError as e:
    raise SystemExit('reading PyTorch checkpoints needs PyTorch: pip install "ecar-jax[convert]"') from e
  torch.serialization.add_safe_globals([argparse.Namespace])  # MAR checkpoints store their args
  sd = torch.load(path, map_location='cpu', weights_only=True)
  for wrapper in entries:
    if isinstance(sd, dict) and isinstance(sd.get(wrapper), dict):
      sd = sd[wrapper]
      break
  out = {}
  for k, v in sd.items():
    if not hasattr(v, 'numpy'):
      raise ValueError(f'{path}: entry {k!r} is a {type(v).__name__}, not a tensor')
    out[k] = (v.float() if v.is_floating_point() else v).numpy()
  return strip_prefix(out, 'module.')


def convert_var_files(vae_path: str, var_path: str, depth: int, out: str,
                      var_cfg: VARConfig | None = None, vq_cfg: VQVAEConfig | None = None) -> None:
  """Official files -> checkpoint at `out`; configs default to the official 256 px models."""
  var_sd = load_state_dict(var_path)
  found = infer_var_depth(var_sd)
  if found != depth:
    raise ValueError(f'--depth {depth} but {var_path} holds a VAR of depth {found}')
  vq_cfg = vq_cfg or VQVAEConfig()
  var_cfg = var_cfg or VARConfig(depth=depth)
  params = {'vqvae': convert_vqvae(load_state_dict(vae_path), vq_cfg),
            'var': convert_var(var_sd, var_cfg)}
  checkpoint.save_params(out, params, {'family': 'var', 'depth': depth, 'vae': vae_path, 'var': var_path})
  print(f'wrote VAR d{depth} + VQVAE params to {out}')


def convert_mar_files(vae_path: str, mar_path: str, model: str, out: str, ema: bool = True,
                      mar_cfg: mar_lib.MARConfig | None = None, vae_cfg=None) -> None:
  """Official KL-16 VAE + MAR checkpoint -> checkpoint at `out` (EMA weights by default, as the
  official evaluation samples with)."""
  mar_cfg = mar_cfg or MAR_SIZES[model]()
  vae_cfg = vae_cfg or KL16
  entries = ('model_ema', 'model') if ema else ('model',)
  params = {'vae': convert_autoencoder_kl(load_state_dict(vae_path), vae_cfg),
            'mar': convert_mar(load_state_dict(mar_path, entries), mar_cfg)}
  checkpoint.save_params(out, params, {'family': 'mar', 'model': model, 'ema': ema, 'vae': vae_path,
                                       'mar': mar_path})
  print(f'wrote MAR-{model} + KL-16 VAE params to {out}')


def convert_sdxl_vae_file(vae_path: str, out: str, vae_cfg=None) -> None:
  """The SDXL VAE in the diffusers layout (diffusion_pytorch_model.safetensors) -> checkpoint {'vae'}
  at `out`, the frozen tokenizer of E-CAR's latent space (configs/ecar.py's vae_ckpt)."""
  vae_cfg = vae_cfg or SDXL_F8C4
  params = {'vae': convert_diffusers_vae(load_state_dict(vae_path), vae_cfg)}
  checkpoint.save_params(out, params, {'family': 'ecar', 'model': 'sdxl-vae', 'vae': vae_path})
  print(f'wrote SDXL VAE params to {out}')


def convert_lpips_files(vgg_path: str, lin_path: str, out: str) -> None:
  """torchvision's vgg16 weights + the lpips package's v0.1 vgg lin weights -> checkpoint {'lpips'} at
  `out`, the perceptual loss of VQVAE training (configs/var.py's lpips_ckpt)."""
  params = {'lpips': convert_lpips(load_state_dict(vgg_path), load_state_dict(lin_path))}
  checkpoint.save_params(out, params, {'model': 'lpips-vgg-v0.1', 'vgg': vgg_path, 'lin': lin_path})
  print(f'wrote LPIPS (vgg, v0.1) params to {out}')


def convert_inception_file(pth_path: str, out: str) -> None:
  """pytorch-fid's pt_inception-2015-12-05-6726825d.pth -> checkpoint {'inception'} at `out`, the feature
  network of FID, sFID, IS and precision/recall (`var_models.convert.inception.load_inception` reads it)."""
  params = {'inception': convert_inception(load_state_dict(pth_path))}
  checkpoint.save_params(out, params, {'model': 'fid-inception-v3-2015-12-05', 'pth': pth_path})
  print(f'wrote the FID Inception-v3 params to {out}')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog='python -m var_models.convert', description=__doc__)
  sub = parser.add_subparsers(dest='family', required=True)
  v = sub.add_parser('var', help='VQVAE (vae_ch160v4096z32.pth) + VAR (var_dN.pth)')
  v.add_argument('--vae', required=True, help='vae_ch160v4096z32.pth (or .npz / .safetensors)')
  v.add_argument('--var', required=True, help='var_d16.pth ... var_d30.pth')
  v.add_argument('--depth', type=int, required=True, choices=(16, 20, 24, 30))
  v.add_argument('--out', required=True, help='output checkpoint directory')
  m = sub.add_parser('mar', help='KL-16 VAE (kl16.ckpt) + MAR (checkpoint-last.pth)')
  m.add_argument('--vae', required=True, help='kl16.ckpt (or .npz / .safetensors)')
  m.add_argument('--mar', required=True, help='checkpoint-last.pth of MAR-B/L/H')
  m.add_argument('--model', required=True, choices=sorted(MAR_SIZES))
  m.add_argument('--no-ema', dest='ema', action='store_false', help="use 'model' instead of 'model_ema'")
  m.add_argument('--out', required=True, help='output checkpoint directory')
  x = sub.add_parser('sdxl-vae', help='SDXL VAE, diffusers layout (diffusion_pytorch_model.safetensors)')
  x.add_argument('--vae', required=True, help='diffusion_pytorch_model.safetensors (or .npz)')
  x.add_argument('--out', required=True, help='output checkpoint directory')
  lp = sub.add_parser('lpips', help="LPIPS 'vgg' v0.1: torchvision's vgg16 + the lpips package's lin weights")
  lp.add_argument('--vgg', required=True, help="torchvision's vgg16 state dict (vgg16-397923af.pth, or .npz)")
  lp.add_argument('--lin', required=True, help="the lpips package's weights/v0.1/vgg.pth (or .npz)")
  lp.add_argument('--out', required=True, help='output checkpoint directory')
  fid = sub.add_parser('inception', help="FID's Inception-v3 (TF 2015-12-05) in pytorch-fid's layout")
  fid.add_argument('--pth', required=True, help='pt_inception-2015-12-05-6726825d.pth (or .npz)')
  fid.add_argument('--out', required=True, help='output checkpoint directory')
  args = parser.parse_args(argv)
  try:
    if args.family == 'var':
      convert_var_files(args.vae, args.var, args.depth, args.out)
    elif args.family == 'mar':
      convert_mar_files(args.vae, args.mar, args.model, args.out, args.ema)
    elif args.family == 'lpips':
      convert_lpips_files(args.vgg, args.lin, args.out)
    elif args.family == 'inception':
      convert_inception_file(args.pth, args.out)
    else:
      convert_sdxl_vae_file(args.vae, args.out)
  except ValueError as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  main()
