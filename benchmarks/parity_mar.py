"""Parity of our MAR (converter, MAE encoder/decoder, DiffLoss denoiser) with the official PyTorch code.

  PYTHONPATH=. /work/venvs/torch/bin/python benchmarks/parity_mar.py --official /work/official/mar

Needs torch, timm and the JAX stack in one interpreter; the official models/mar.py is
imported from --official at run time. It builds the official MAR (mar_base by default,
with its released DiffLoss size) on the CPU in float32 and eval mode, re-randomises
every parameter (the official init leaves fake_latent-like tables at 0.02 and the
DiffLoss output layer at zero, which would hide errors), converts the state dict with
`convert_mar` and compares, for random tokens, a random mask with --n-masked tokens
per row and class embeddings (the last row CFG's fake class):
  * forward_mae_encoder against our `encode` in the gathered (keep_idx) form;
  * forward_mae_decoder's z against our `decode`, gathered and key-masked;
  * the DiffLoss denoiser `diffloss.net(x, t, c)` against ours.
Only these official entry points run: its mask and order samplers need CUDA.
Prints one JSON line per check (max relative error); exits 1 if one exceeds --tol.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from parity_common import randomize_, rel_err, report
from var_models.convert.mar import convert_mar
from var_models.mar import model as mar
from var_models.mar.model import MAR

jax.config.update('jax_default_matmul_precision', 'highest')

# The released DiffLoss sizes (depth, width) of each official builder.
_DIFFLOSS = {'base': (6, 1024), 'large': (8, 1280), 'huge': (12, 1536)}
_TABLES = ('class_emb.weight', 'fake_latent', 'mask_token', 'encoder_pos_embed_learned',
           'decoder_pos_embed_learned', 'diffusion_pos_embed_learned')


def build_official(official: str, size: str) -> torch.nn.Module:
  if official not in sys.path:
    sys.path.insert(0, official)
  from models import mar as official_mar   # pylint: disable=import-outside-toplevel
  depth, width = _DIFFLOSS[size]
  return getattr(official_mar, f'mar_{size}')(diffloss_d=depth, diffloss_w=width).eval()


def random_inputs(cfg: mar.MARConfig, batch: int, n_masked: int, seed: int):
  rng = np.random.default_rng(seed)
  tokens = rng.standard_normal((batch, cfg.seq_len, cfg.token_embed_dim)).astype(np.float32)
  mask = np.zeros((batch, cfg.seq_len), bool)
  for row in mask:
    row[rng.permutation(cfg.seq_len)[:n_masked]] = True
  labels = rng.integers(0, cfg.class_num, batch)
  return tokens, mask, labels


def ours(cfg: mar.MARConfig, params, tokens, mask, labels):
  """(encoder output gathered, z gathered, z key-masked); the last row uses the fake class."""
  model = MAR(cfg)
  n_known = cfg.seq_len - int(mask[0].sum())

  @jax.jit
  def run(params, tokens, mask, labels):
    v = {'params': params}
    ce = model.apply(v, labels, method=MAR.class_embedding)
    ce = ce.at[-1].set(model.apply(v, 1, method=MAR.fake_class)[0])
    keep = mar.keep_indices(cfg, mask, n_known)
    x = model.apply(v, tokens, mask, ce, keep, method=MAR.encode)
    z_gather = model.apply(v, x, mask, keep, method=MAR.decode)
    z_keys = model.apply(v, model.apply(v, tokens, mask, ce, method=MAR.encode), mask, method=MAR.decode)
    return x, z_gather, z_keys

  return [np.asarray(a) for a in run(params, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(labels))]


@torch.no_grad()
def official_forward(model, tokens, mask, labels):
  ce = model.class_emb(torch.from_numpy(labels))
  ce[-1] = model.fake_latent[0]
  m = torch.from_numpy(mask).float()
  x = model.forward_mae_encoder(torch.from_numpy(tokens), m, ce)
  return x.numpy(), model.forward_mae_decoder(x, m).numpy()


def diffloss_check(cfg: mar.MARConfig, model, params, rows: int, seed: int) -> float:
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, cfg.token_embed_dim)).astype(np.float32)
  t = rng.integers(0, 1000, rows)
  c = rng.standard_normal((rows, cfg.decoder_embed_dim)).astype(np.float32)
  with torch.no_grad():
    want = model.diffloss.net(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(c)).numpy()
  got = mar.diffloss_net(cfg).apply({'params': params['diffloss']}, jnp.asarray(x), jnp.asarray(t), jnp.asarray(c))
  return rel_err(got, want)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--official', required=True, help='root of the official MAR repository')
  ap.add_argument('--size', default='base', choices=sorted(_DIFFLOSS))
  ap.add_argument('--n-masked', type=int, nargs='+', default=[64, 200], help='masked tokens per row')
  ap.add_argument('--batch', type=int, default=4)
  ap.add_argument('--seed', type=int, default=0)
  ap.add_argument('--tol', type=float, default=1e-4)
  args = ap.parse_args(argv)

  model = build_official(args.official, args.size)
  randomize_(model, torch.Generator().manual_seed(args.seed), _TABLES)
  cfg = getattr(mar, args.size)()
  params = convert_mar({k: v.numpy() for k, v in model.state_dict().items()}, cfg)
  errs = []
  for n_masked in args.n_masked:
    tokens, mask, labels = random_inputs(cfg, args.batch, n_masked, args.seed + n_masked)
    x_ref, z_ref = official_forward(model, tokens, mask, labels)
    x, z_gather, z_keys = ours(cfg, params, tokens, mask, labels)
    r = report(size=args.size, n_masked=n_masked, batch=args.batch, encoder_rel_err=rel_err(x, x_ref),
               z_gathered_rel_err=rel_err(z_gather, z_ref), z_key_masked_rel_err=rel_err(z_keys, z_ref),
               z_max_abs=float(np.max(np.abs(z_ref))))
    errs += [r['encoder_rel_err'], r['z_gathered_rel_err'], r['z_key_masked_rel_err']]
  errs.append(report(check='diffloss_net', rel_err=diffloss_check(cfg, model, params, 64, args.seed))['rel_err'])
  ok = max(errs) <= args.tol
  report(ok=ok, max_rel_err=max(errs), tol=args.tol)
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
