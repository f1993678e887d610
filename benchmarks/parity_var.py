"""Parity of our VAR (converter, teacher-forced forward, sampler) with the official PyTorch code.

  PYTHONPATH=. /work/venvs/torch/bin/python benchmarks/parity_var.py --official /work/official/VAR \
      --depths 4 16 --sample-depths 4

Needs torch and the JAX stack in one interpreter; the official code is imported from
--official at run time. For each depth it builds the official VQVAE + VAR with
`build_vae_var` (CPU, float32, flash/fused kernels off, math SDPA), re-randomises every
parameter (the builder skips reset_parameters, so some weights are left uninitialised;
the scales below keep activations O(1) so every block, gate and modulation matters),
converts both state dicts with our converters and compares, on the same labels:
  * the teacher-forcing input both VQVAEs derive from the same random token maps;
  * teacher-forced logits on the official teacher-forcing input (max relative error);
  * with --sample-depths: greedy (top_k=1) CFG sampling against
    `autoregressive_infer_cfg`, whose token maps and guided logits are recorded by
    wrapping the official `sample_with_top_k_top_p_`; then the decoded images.
Prints one JSON line per check; exits 1 if a logits error exceeds --tol or indices differ.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from parity_common import randomize_, rel_err, report
from var_models.convert.var import convert_var
from var_models.convert.vqvae import convert_vqvae
from var_models.tokenizers.vqvae import VQVAE, VQVAEConfig
from var_models.var.model import VAR, VARConfig

jax.config.update('jax_default_matmul_precision', 'highest')


def build_official(official: str, depth: int, shared_aln: bool, patch_nums: tuple[int, ...]):
  if official not in sys.path:
    sys.path.insert(0, official)
  from models import build_vae_var   # pylint: disable=import-outside-toplevel
  with contextlib.redirect_stdout(io.StringIO()):   # the builder prints its whole config
    vae, var = build_vae_var(device='cpu', patch_nums=patch_nums, depth=depth, shared_aln=shared_aln,
                             attn_l2_norm=True, flash_if_available=False, fused_if_available=False)
  var.cond_drop_rate = 0.0   # the official forward drops labels even in eval mode
  return vae.eval(), var.eval()


_TABLES = ('class_emb.weight', 'lvl_embed.weight', 'pos_start', 'pos_1LC', 'quantize.embedding.weight')


def state_dict_np(module: torch.nn.Module) -> dict:
  return {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}


def our_configs(depth: int, shared_aln: bool, patch_nums: tuple[int, ...]):
  return (VARConfig(depth=depth, shared_aln=shared_aln, patch_nums=patch_nums, attn_l2_norm=True),
          VQVAEConfig(patch_nums=patch_nums))


def check_teacher_forcing(vae, var, var_params, vq_params, var_cfg, vq_cfg, labels, rng) -> dict:
  sched = var_cfg.schedule
  idx = [rng.integers(0, var_cfg.vocab_size, (len(labels), n)) for n in sched.lengths]
  with torch.no_grad():
    x_tf = vae.quantize.idxBl_to_var_input([torch.from_numpy(i) for i in idx])
    want = var(torch.from_numpy(labels), x_tf).numpy()
  ours_x = VQVAE(vq_cfg).apply({'params': vq_params}, [jnp.asarray(i) for i in idx],
                               method=VQVAE.indices_to_var_input)
  got = jax.jit(lambda p, lab, x: VAR(var_cfg).apply({'params': p}, lab, x))(
      var_params, jnp.asarray(labels), jnp.asarray(x_tf.numpy()))
  return report(check='teacher_forced', depth=var_cfg.depth, shared_aln=var_cfg.shared_aln,
                x_tf_rel_err=rel_err(ours_x, x_tf.numpy()), logits_rel_err=rel_err(got, want),
                logits_max_abs=float(np.max(np.abs(want))))


def official_greedy(var, labels, guidance: float):
  """(token maps per scale, guided logits per scale, images [B, H, W, 3]) of the official sampler."""
  import models.var as official_var   # pylint: disable=import-outside-toplevel
  original, idx, logits = official_var.sample_with_top_k_top_p_, [], []

  def recording(logits_BlV, **kw):
    logits.append(logits_BlV.clone().numpy())   # before the in-place top-k masking
    out = original(logits_BlV, **kw)
    idx.append(out[:, :, 0].numpy())
    return out

  official_var.sample_with_top_k_top_p_ = recording
  try:
    with torch.no_grad():
      img = var.autoregressive_infer_cfg(len(labels), torch.from_numpy(labels), g_seed=0, cfg=guidance,
                                         top_k=1, top_p=0.0)
  finally:
    official_var.sample_with_top_k_top_p_ = original
  return idx, logits, img.permute(0, 2, 3, 1).numpy()


def check_sampling(var, var_params, vq_params, var_cfg, vq_cfg, labels, guidance: float) -> dict:
  from var_models.var.sampler import make_sampler   # pylint: disable=import-outside-toplevel
  want_idx, want_logits, want_img = official_greedy(var, labels, guidance)
  sample = make_sampler(var_cfg, vq_cfg, return_logits=True)
  img, aux = sample({'var': var_params, 'vqvae': vq_params}, jax.random.key(0), labels,
                    cfg=guidance, top_k=1, top_p=1.0)
  same = [bool(np.array_equal(np.asarray(g), w)) for g, w in zip(aux['indices'], want_idx)]
  first_diff = same.index(False) if False in same else None
  # Logits are comparable up to the first scale whose tokens differ (later inputs diverge).
  upto = len(same) if first_diff is None else first_diff + 1
  return report(check='greedy_sampling', depth=var_cfg.depth, shared_aln=var_cfg.shared_aln,
                indices_identical=all(same), first_differing_scale=first_diff,
                guided_logits_rel_err=max(rel_err(g, w) for g, w in zip(aux['logits'][:upto], want_logits)),
                image_max_abs_err=float(np.max(np.abs(np.asarray(img) - want_img))) if all(same) else None)


def run_depth(args, depth: int, sample: bool) -> list[dict]:
  patch_nums = tuple(args.patch_nums)
  vae, var = build_official(args.official, depth, args.shared_aln, patch_nums)
  gen = torch.Generator().manual_seed(args.seed)
  randomize_(vae, gen, _TABLES)
  randomize_(var, gen, _TABLES)
  var_cfg, vq_cfg = our_configs(depth, args.shared_aln, patch_nums)
  var_params = jax.tree_util.tree_map(jnp.asarray, convert_var(state_dict_np(var), var_cfg))
  vq_params = jax.tree_util.tree_map(jnp.asarray, convert_vqvae(state_dict_np(vae), vq_cfg))
  rng = np.random.default_rng(args.seed)
  labels = rng.integers(0, var_cfg.num_classes, args.batch)
  results = [check_teacher_forcing(vae, var, var_params, vq_params, var_cfg, vq_cfg, labels, rng)]
  if sample:
    results.append(check_sampling(var, var_params, vq_params, var_cfg, vq_cfg, labels, args.guidance))
  return results


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument('--official', required=True, help='root of a FoundationVision/VAR checkout')
  ap.add_argument('--depths', type=int, nargs='+', default=[4])
  ap.add_argument('--sample-depths', type=int, nargs='*', default=[], help='depths to also check greedy sampling at')
  ap.add_argument('--shared-aln', action='store_true')
  ap.add_argument('--patch-nums', type=int, nargs='+', default=[1, 2, 3, 4, 5, 6, 8, 10, 13, 16])
  ap.add_argument('--batch', type=int, default=2)
  ap.add_argument('--guidance', type=float, default=1.5)
  ap.add_argument('--seed', type=int, default=0)
  ap.add_argument('--tol', type=float, default=1e-4, help='max relative error of logits')
  args = ap.parse_args()
  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  ok = True
  with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
    for depth in sorted(set(args.depths) | set(args.sample_depths)):
      for r in run_depth(args, depth, depth in args.sample_depths):
        ok &= r.get('logits_rel_err', 0) <= args.tol and r.get('guided_logits_rel_err', 0) <= args.tol
        ok &= r.get('indices_identical', True)
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
