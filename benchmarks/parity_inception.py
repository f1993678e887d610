"""Parity of var_models.tokenizers.inception with pytorch-fid's FID Inception, float32 on CPU.

  /work/venvs/torch/bin/pip install pytorch-fid --no-deps
  PYTHONPATH=. /work/venvs/torch/bin/python benchmarks/parity_inception.py

Needs torch, torchvision, pytorch-fid and the JAX stack in one interpreter. Nothing is downloaded:
`fid_inception_v3()` builds its network as usual but is handed, instead of the released weights, the
state dict of torchvision's Inception3(num_classes=1008, aux_logits=False) (the FID blocks keep its
names and shapes). Every parameter and BatchNorm statistic is then redrawn: convs ~ N(0, 2 / fan_in)
so activations stay O(1) through up to 47 conv layers, BN gains 1 + N(0, 0.1^2), BN shifts and running
means N(0, 0.1^2), running variances U(0.5, 1.5), fc ~ N(0, 1 / 2048). The reference is pytorch-fid's
own InceptionV3 (resize_input, normalize_input) around that network: 'pool' its 2048-d block,
'spatial' Mixed_6d.branch1x1's output (a forward hook) sliced to 7 channels and flattened in (H, W, C)
order as ADM does, 'logits' pool @ fc.weight.T. The state dict goes through `convert_inception`.
Prints one JSON line per input size and output (max |ours - official| / max |official|); exits 1 if
one exceeds --tol.
"""
from __future__ import annotations

import argparse
import sys
from unittest import mock

import jax
import numpy as np
import torch

from parity_common import rel_err, report
from var_models.convert.inception import convert_inception
from var_models.tokenizers.inception import SPATIAL_CHANNELS, FIDInceptionV3


@torch.no_grad()
def _redraw(network: torch.nn.Module, gen: torch.Generator) -> None:
  tensors = dict(network.named_parameters()) | dict(network.named_buffers())
  for name, t in tensors.items():
    if not t.is_floating_point():  # num_batches_tracked
      continue
    noise = torch.randn(t.shape, generator=gen)
    if name.endswith('running_var'):
      t.copy_(0.5 + torch.rand(t.shape, generator=gen))
    elif name.endswith('bn.weight'):
      t.copy_(1 + 0.1 * noise)
    elif t.ndim > 1:  # conv [out, in, kh, kw] and fc [1008, 2048]
      fan_in = t[0].numel()
      t.copy_(noise * (2.0 / fan_in if t.ndim == 4 else 1.0 / fan_in) ** 0.5)
    else:
      t.copy_(0.1 * noise)


def build_official(seed: int):
  """(network, wrapper): pytorch-fid's fid_inception_v3() with random weights, and its InceptionV3 around it."""
  import pytorch_fid.inception as fid  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=protected-access
  layout = fid._inception_v3(num_classes=1008, aux_logits=False, weights=None).state_dict()
  with mock.patch.object(fid, 'load_state_dict_from_url', lambda *args, **kwargs: layout):
    network = fid.fid_inception_v3().eval()
  _redraw(network, torch.Generator().manual_seed(seed))
  with mock.patch.object(fid, 'fid_inception_v3', lambda: network):
    wrapper = fid.InceptionV3([fid.InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).eval()
  return network, wrapper


def official_features(network, wrapper, images: np.ndarray) -> dict[str, np.ndarray]:
  """images [B, H, W, 3] in [0, 1] -> {'pool', 'logits', 'spatial'} from pytorch-fid's forward."""
  taps = []
  hook = network.Mixed_6d.branch1x1.register_forward_hook(lambda module, args, out: taps.append(out))
  with torch.no_grad():
    pool = wrapper(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()))[0].flatten(1)
    logits = pool @ network.fc.weight.T
  hook.remove()
  spatial = taps[0][:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).flatten(1)
  return {'pool': pool.numpy(), 'logits': logits.numpy(), 'spatial': spatial.numpy()}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument('--batch', type=int, default=4)
  ap.add_argument('--sizes', default='64,299,512', help='square input sizes: up-, not and downsampled to 299')
  ap.add_argument('--tol', type=float, default=1e-4)
  ap.add_argument('--seed', type=int, default=0)
  args = ap.parse_args()

  network, wrapper = build_official(args.seed)
  params = convert_inception({k: v.numpy() for k, v in network.state_dict().items()})
  ours = jax.jit(lambda p, x: FIDInceptionV3().apply({'params': p}, x))
  rng = np.random.default_rng(args.seed)
  ok = True
  for size in (int(s) for s in args.sizes.split(',')):
    images = rng.uniform(0, 1, (args.batch, size, size, 3)).astype(np.float32)
    want = official_features(network, wrapper, images)
    got = ours(params, images)
    for key, official in want.items():
      err = rel_err(got[key], official)
      report(check=key, size=size, shape=list(official.shape), rel_err=err,
             max_official=float(np.abs(official).max()), ok=err <= args.tol)
      ok &= err <= args.tol
  print('PASS' if ok else 'FAIL')
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
