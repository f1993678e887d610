"""Parity of var_models.tokenizers.vqvae with the official VAR VQVAE (PyTorch), float32 on CPU.

Builds the official model from the unpacked repo given by --official, gives every
parameter fresh random values, converts its state dict with
`convert_vqvae`, and compares features, token indices (must be identical),
f_hat, the VAR teacher-forcing input, the sampler chain, decoded images and the
training forward. Errors are max|jax - torch| / max|torch|.

  python benchmarks/parity_vqvae.py --official /work/official/VAR

Needs torch and jax in the same interpreter. Exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from var_models.convert.vqvae import convert_vqvae  # noqa: E402
from var_models.tokenizers.vqvae import VQVAE, VQVAEConfig  # noqa: E402
from parity_common import rel_err  # noqa: E402


def load_official(path: str):
  # The official package imports `dist` from its repo root.
  sys.path.insert(0, os.path.abspath(path))
  from models.vqvae import VQVAE as OfficialVQVAE
  return OfficialVQVAE


def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
  """Every parameter redrawn: weights ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2)."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if p.ndim >= 2:
        p.copy_(noise / np.sqrt(p[0].numel()))
      elif name.endswith('weight'):
        p.copy_(1 + 0.1 * noise)
      else:
        p.copy_(0.1 * noise)


def nhwc(t: torch.Tensor) -> np.ndarray:
  return t.detach().permute(0, 2, 3, 1).numpy()


class Report:
  def __init__(self, tol: float):
    self.tol, self.ok = tol, True

  def close(self, name: str, a, ref) -> None:
    e = rel_err(a, ref)
    self.ok &= e <= self.tol
    print(f'{name:42s} rel err {e:.3e}  {"ok" if e <= self.tol else "FAIL"}')

  def same(self, name: str, a_list, ref_list) -> None:
    bad = sum(int(np.sum(np.asarray(a) != np.asarray(r))) for a, r in zip(a_list, ref_list))
    total = sum(np.asarray(r).size for r in ref_list)
    self.ok &= bad == 0
    print(f'{name:42s} {bad} of {total} differ  {"ok" if bad == 0 else "FAIL"}')


def torch_side(tm, img: torch.Tensor, pns: tuple[int, ...]) -> dict:
  """Everything the official model computes for `img` [B, 3, H, W]."""
  q, sn = tm.quantize, len(pns)
  out = {'f': tm.quant_conv(tm.encoder(img))}
  out['idx'] = q.f_to_idxBl_or_fhat(out['f'], to_fhat=False)
  out['fhats'] = q.f_to_idxBl_or_fhat(out['f'], to_fhat=True)
  b, c = img.shape[0], q.Cvae
  maps = [q.embedding(i).transpose(1, 2).reshape(b, c, pn, pn) for i, pn in zip(out['idx'], pns)]
  out['fhat'] = q.embed_to_fhat(maps, all_to_max_scale=True, last_one=True)
  out['img'] = tm.fhat_to_img(out['fhat'])
  out['var_input'] = q.idxBl_to_var_input(out['idx'])
  f_hat, chain = torch.zeros_like(out['fhat']), []
  for si in range(sn):
    f_hat, nxt = q.get_next_autoregressive_input(si, sn, f_hat.clone(), maps[si])
    chain.append(nxt.clone())
  out['chain'] = chain
  out['rec'], _, out['vq_loss'] = tm(img)
  return out


def jax_side(model: VQVAE, variables, img: np.ndarray, ref: dict, pns: tuple[int, ...]) -> dict:
  """The JAX model's results; the quantizer/decoder parts also run on the torch inputs to isolate them."""
  run = lambda method, *a: jax.jit(lambda v, *x: model.apply(v, *x, method=method))(variables, *a)
  f_ref = nhwc(ref['f'])
  idx_ref = [i.numpy().astype(np.int32) for i in ref['idx']]
  out = {'f': run(VQVAE.encode, img), 'idx_e2e': run(VQVAE.img_to_indices, img)}
  out['idx'] = run(VQVAE.f_to_indices, f_ref)
  out['fhats'] = run(VQVAE.f_to_fhats, f_ref)
  out['fhat'] = run(VQVAE.indices_to_fhat, idx_ref)
  out['img'] = run(VQVAE.fhat_to_img, nhwc(ref['fhat']))
  out['img_e2e'] = run(VQVAE.indices_to_img, out['idx_e2e'])
  out['var_input'] = run(VQVAE.indices_to_var_input, idx_ref)
  f_hat, chain = jnp.zeros_like(out['fhat']), []
  b, c = img.shape[0], f_ref.shape[-1]
  for si, pn in enumerate(pns):
    h = run(VQVAE.embed, idx_ref[si]).reshape(b, pn, pn, c)
    f_hat, nxt = model.apply(variables, si, f_hat, h, method=VQVAE.next_ar_input)
    chain.append(nxt)
  out['chain'] = chain
  out['rec'], out['vq_loss'] = run(VQVAE.__call__, img)
  return out


def compare(rep: Report, j: dict, t: dict) -> None:
  rep.close('encode f', j['f'], nhwc(t['f']))
  rep.same('indices from torch f', j['idx'], [i.numpy() for i in t['idx']])
  rep.same('indices end to end (img_to_indices)', j['idx_e2e'], [i.numpy() for i in t['idx']])
  rep.close('per-scale f_hat (max over scales)', np.stack(j['fhats']), np.stack([nhwc(x) for x in t['fhats']]))
  rep.close('indices_to_fhat', j['fhat'], nhwc(t['fhat']))
  rep.close('indices_to_var_input', j['var_input'], t['var_input'].numpy())
  for si, (a, r) in enumerate(zip(j['chain'], t['chain'])):
    rep.close(f'next_ar_input scale {si}', a, nhwc(r))
  rep.close('fhat_to_img', j['img'], nhwc(t['img']))
  rep.close('indices_to_img end to end', j['img_e2e'], nhwc(t['img']))
  rep.close('training forward: reconstruction', j['rec'], nhwc(t['rec']))
  rep.close('training forward: vq loss', j['vq_loss'], t['vq_loss'].numpy())


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument('--official', required=True, help='unpacked FoundationVision/VAR repository')
  ap.add_argument('--ch', type=int, default=160)
  ap.add_argument('--batch', type=int, default=2)
  ap.add_argument('--share-quant-resi', type=int, default=4)
  ap.add_argument('--znorm', action='store_true')
  ap.add_argument('--tol', type=float, default=1e-4)
  ap.add_argument('--seed', type=int, default=0)
  args = ap.parse_args()

  cfg = VQVAEConfig(ch=args.ch, share_quant_resi=args.share_quant_resi, using_znorm=args.znorm)
  tm = load_official(args.official)(
      vocab_size=cfg.vocab_size, z_channels=cfg.z_channels, ch=cfg.ch, beta=cfg.beta, using_znorm=cfg.using_znorm,
      quant_conv_ks=cfg.quant_conv_ks, quant_resi=cfg.quant_resi, share_quant_resi=cfg.share_quant_resi,
      v_patch_nums=cfg.patch_nums, test_mode=True)
  gen = torch.Generator().manual_seed(args.seed)
  randomise(tm, gen)
  img = torch.rand((args.batch, 3, cfg.image_size, cfg.image_size), generator=gen) * 2 - 1
  with torch.no_grad():  # a codebook on the scale of f, so the argmins are not degenerate
    f_std = tm.quant_conv(tm.encoder(img)).std()
    tm.quantize.embedding.weight.copy_(torch.randn(tm.quantize.embedding.weight.shape, generator=gen) * f_std)

  # The official training forward asks torch.distributed for the world size.
  tdist.init_process_group('gloo', init_method=f'file://{tempfile.mkdtemp()}/pg', rank=0, world_size=1)
  with torch.no_grad():
    t = torch_side(tm, img, cfg.patch_nums)
  tdist.destroy_process_group()

  sd = {k: v.numpy() for k, v in tm.state_dict().items()}
  variables = {'params': convert_vqvae(sd, cfg)}
  j = jax_side(VQVAE(cfg), variables, nhwc(img), t, cfg.patch_nums)
  used = len(np.unique(np.concatenate([i.numpy().ravel() for i in t['idx']])))
  print(f'cfg ch={cfg.ch} {cfg.image_size}px batch={args.batch} share_quant_resi={cfg.share_quant_resi} '
        f'znorm={cfg.using_znorm}; {used} distinct codes used; tol {args.tol}')
  rep = Report(args.tol)
  compare(rep, j, t)
  print('PASS' if rep.ok else 'FAIL')
  return 0 if rep.ok else 1


if __name__ == '__main__':
  sys.exit(main())
