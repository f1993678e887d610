"""The Inception-v3 of FID, sFID, IS and precision/recall, NHWC: TensorFlow's 2015-12-05 ImageNet graph
(classify_image_graph_def.pb, the one TTUR's FID, improved-gan's IS and ADM's evaluator load) as
pytorch-fid ports it (`pytorch_fid.inception.fid_inception_v3`).

The layers are torchvision's Inception3 with 1008 classes and no aux head; every conv is
conv (no bias) -> BatchNorm (eval mode, eps 1e-3) -> ReLU. Where the 2015 graph differs from
torchvision, pytorch-fid's FID blocks follow the graph, and so does this module: the 3x3 pool of
branch_pool averages over the in-image taps only (count_include_pad=False) in Mixed_5b-d, 6b-e and
7b, and is a max pool in Mixed_7c. Modules carry pytorch-fid's names (Mixed_6d/branch1x1/conv,
.../bn), so `var_models.convert.inception` maps names one to one.

Input as pytorch-fid's InceptionV3(resize_input=True, normalize_input=True): images in [0, 1] of
any size, resized bilinearly to 299 x 299 as F.interpolate(mode='bilinear', align_corners=False)
(half-pixel centres, no antialiasing, also when downsampling), then mapped to [-1, 1] by 2x - 1.
ADM's evaluator feeds the graph [0, 255] images, which it resizes with TF1's ResizeBilinear
(source index dst * in / out, no half-pixel offset) and maps by (x - 128) / 128, so its features
are close to, not equal to, these (at 299 px too: 2x - 1 is (255x - 127.5) / 127.5).

Outputs, float32 (convs and fc at HIGHEST precision, so that a GPU does not drop them to TF32:
the statistics are compared with ones computed in float32):
  'pool'    [B, 2048]  the final average pool (the graph's pool_3): FID and precision/recall.
  'logits'  [B, 1008]  pool @ fc.weight.T without fc's bias, all 1008 columns: the logits whose
                       softmax IS scores, as improved-gan's and ADM's evaluators take them (pool_3
                       times softmax/logits/MatMul's weight; torch-fidelity's 'logits_unbiased').
  'spatial' [B, 2023]  ADM's sFID features: mixed_6/conv:0[..., :7] flattened in (H, W, C) order.
                       The graph numbers its blocks mixed, mixed_1, ..., mixed_10 (Mixed_5b ...
                       Mixed_7c), so mixed_6 is Mixed_6d, and its 'conv' is the 1x1 branch, the node
                       after conv/batchnorm: Mixed_6d.branch1x1 after its ReLU, 7 of its 192
                       channels over the 17 x 17 grid.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

SIZE = 299
BN_EPS = 1e-3
NUM_LOGITS = 1008
SPATIAL_CHANNELS = 7  # of mixed_6/conv's 192, as ADM's evaluator slices them
_HIGHEST = jax.lax.Precision.HIGHEST


def preprocess(images: jax.Array) -> jax.Array:
  """images [B, H, W, 3] in [0, 1] -> [B, 299, 299, 3] in [-1, 1], as pytorch-fid's input path.

  Without antialiasing, jax's 'linear' kernel is the two-tap tent around PyTorch's source
  coordinate (i + 0.5) * in / out - 0.5, and dropping an out-of-image tap then renormalising is
  PyTorch's edge clamp, so this is F.interpolate's bilinear for up- and downsampling alike.
  """
  b, _, _, c = images.shape
  x = jax.image.resize(images.astype(jnp.float32), (b, SIZE, SIZE, c), 'linear', antialias=False)
  return 2 * x - 1


def pool_3x3(x: jax.Array, kind: str) -> jax.Array:
  """branch_pool's 3x3, stride 1, padding 1 pool of x [B, H, W, C] -> [B, H, W, C]; 'avg' counts the
  in-image taps only (TF's average pool), 'max' pads with -inf."""
  pad = ((1, 1), (1, 1))
  if kind == 'max':
    return nn.max_pool(x, (3, 3), (1, 1), pad)
  return nn.avg_pool(x, (3, 3), (1, 1), pad, count_include_pad=False)


def _reduce(x: jax.Array) -> jax.Array:
  """The 3x3 stride-2 unpadded max pool of the stem and of Mixed_6a / 7a."""
  return nn.max_pool(x, (3, 3), (2, 2))


class BatchNormEval(nn.Module):
  """x [..., C] -> (x - mean) / sqrt(var + 1e-3) * scale + bias with the stored statistics.

  The statistics are params, not batch_stats: the network is frozen, and one tree is what
  `apply({'params': p}, ...)` and the checkpoint hold.
  """

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = (x.shape[-1],)
    scale = self.param('scale', nn.initializers.ones, c)
    bias = self.param('bias', nn.initializers.zeros, c)
    mean = self.param('mean', nn.initializers.zeros, c)
    var = self.param('var', nn.initializers.ones, c)
    return (x - mean) * (scale * jax.lax.rsqrt(var + BN_EPS)) + bias


class ConvBN(nn.Module):
  """x [B, H, W, C] -> relu(bn(conv(x))) [B, H', W', features]: torchvision's BasicConv2d.

  'SAME' is PyTorch's (k - 1) / 2 padding for the odd kernels here at stride 1.
  """
  features: int
  kernel: tuple[int, int]
  strides: int = 1
  padding: str = 'SAME'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Conv(self.features, self.kernel, self.strides, self.padding, use_bias=False, precision=_HIGHEST,
                name='conv')(x)
    return nn.relu(BatchNormEval(name='bn')(x))


def _tower(x: jax.Array, *layers) -> jax.Array:
  """x through ConvBN layers given as (name, features, kernel[, strides, padding]), in order."""
  for name, features, kernel, *rest in layers:
    x = ConvBN(features, kernel, *rest, name=name)(x)
  return x


class InceptionA(nn.Module):
  """x [B, 35, 35, C] -> branches [B, 35, 35, 64 | 64 | 96 | pool_features] (Mixed_5b-d)."""
  pool_features: int

  @nn.compact
  def __call__(self, x: jax.Array) -> list[jax.Array]:
    return [_tower(x, ('branch1x1', 64, (1, 1))),
            _tower(x, ('branch5x5_1', 48, (1, 1)), ('branch5x5_2', 64, (5, 5))),
            _tower(x, ('branch3x3dbl_1', 64, (1, 1)), ('branch3x3dbl_2', 96, (3, 3)), ('branch3x3dbl_3', 96, (3, 3))),
            _tower(pool_3x3(x, 'avg'), ('branch_pool', self.pool_features, (1, 1)))]


class InceptionB(nn.Module):
  """x [B, 35, 35, 288] -> branches [B, 17, 17, 384 | 96 | 288] (Mixed_6a)."""

  @nn.compact
  def __call__(self, x: jax.Array) -> list[jax.Array]:
    return [_tower(x, ('branch3x3', 384, (3, 3), 2, 'VALID')),
            _tower(x, ('branch3x3dbl_1', 64, (1, 1)), ('branch3x3dbl_2', 96, (3, 3)),
                   ('branch3x3dbl_3', 96, (3, 3), 2, 'VALID')),
            _reduce(x)]


class InceptionC(nn.Module):
  """x [B, 17, 17, 768] -> branches [B, 17, 17, 192] x 4 (Mixed_6b-e); 1x7 and 7x1 factorised towers."""
  channels_7x7: int

  @nn.compact
  def __call__(self, x: jax.Array) -> list[jax.Array]:
    c7 = self.channels_7x7
    return [_tower(x, ('branch1x1', 192, (1, 1))),
            _tower(x, ('branch7x7_1', c7, (1, 1)), ('branch7x7_2', c7, (1, 7)), ('branch7x7_3', 192, (7, 1))),
            _tower(x, ('branch7x7dbl_1', c7, (1, 1)), ('branch7x7dbl_2', c7, (7, 1)), ('branch7x7dbl_3', c7, (1, 7)),
                   ('branch7x7dbl_4', c7, (7, 1)), ('branch7x7dbl_5', 192, (1, 7))),
            _tower(pool_3x3(x, 'avg'), ('branch_pool', 192, (1, 1)))]


class InceptionD(nn.Module):
  """x [B, 17, 17, 768] -> branches [B, 8, 8, 320 | 192 | 768] (Mixed_7a)."""

  @nn.compact
  def __call__(self, x: jax.Array) -> list[jax.Array]:
    return [_tower(x, ('branch3x3_1', 192, (1, 1)), ('branch3x3_2', 320, (3, 3), 2, 'VALID')),
            _tower(x, ('branch7x7x3_1', 192, (1, 1)), ('branch7x7x3_2', 192, (1, 7)), ('branch7x7x3_3', 192, (7, 1)),
                   ('branch7x7x3_4', 192, (3, 3), 2, 'VALID')),
            _reduce(x)]


class InceptionE(nn.Module):
  """x [B, 8, 8, C] -> branches [B, 8, 8, 320 | 384 x 4 | 192] (Mixed_7b with 'avg', Mixed_7c with 'max')."""
  pool: str

  @nn.compact
  def __call__(self, x: jax.Array) -> list[jax.Array]:
    b3 = _tower(x, ('branch3x3_1', 384, (1, 1)))
    d3 = _tower(x, ('branch3x3dbl_1', 448, (1, 1)), ('branch3x3dbl_2', 384, (3, 3)))
    return [_tower(x, ('branch1x1', 320, (1, 1))),
            _tower(b3, ('branch3x3_2a', 384, (1, 3))), _tower(b3, ('branch3x3_2b', 384, (3, 1))),
            _tower(d3, ('branch3x3dbl_3a', 384, (1, 3))), _tower(d3, ('branch3x3dbl_3b', 384, (3, 1))),
            _tower(pool_3x3(x, self.pool), ('branch_pool', 192, (1, 1)))]


class FIDInceptionV3(nn.Module):
  """images [B, H, W, 3] in [0, 1] -> {'pool': [B, 2048], 'logits': [B, 1008], 'spatial': [B, 2023]}.

  See the module docstring for what each output is and which metric takes it.
  """

  @nn.compact
  def __call__(self, images: jax.Array) -> dict[str, jax.Array]:
    if images.ndim != 4 or images.shape[-1] != 3:
      raise ValueError(f'FIDInceptionV3 takes RGB images [B, H, W, 3] in [0, 1], got shape {images.shape}')
    x = _tower(preprocess(images), ('Conv2d_1a_3x3', 32, (3, 3), 2, 'VALID'), ('Conv2d_2a_3x3', 32, (3, 3), 1, 'VALID'),
               ('Conv2d_2b_3x3', 64, (3, 3)))
    x = _tower(_reduce(x), ('Conv2d_3b_1x1', 80, (1, 1)), ('Conv2d_4a_3x3', 192, (3, 3), 1, 'VALID'))
    x = _reduce(x)
    for name, pool_features in (('Mixed_5b', 32), ('Mixed_5c', 64), ('Mixed_5d', 64)):
      x = jnp.concatenate(InceptionA(pool_features, name=name)(x), axis=-1)
    x = jnp.concatenate(InceptionB(name='Mixed_6a')(x), axis=-1)
    for name, c7 in (('Mixed_6b', 128), ('Mixed_6c', 160), ('Mixed_6d', 160), ('Mixed_6e', 192)):
      branches = InceptionC(c7, name=name)(x)
      if name == 'Mixed_6d':  # the graph's mixed_6; its branch1x1 is mixed_6/conv
        spatial = branches[0][..., :SPATIAL_CHANNELS]
      x = jnp.concatenate(branches, axis=-1)
    x = jnp.concatenate(InceptionD(name='Mixed_7a')(x), axis=-1)
    x = jnp.concatenate(InceptionE('avg', name='Mixed_7b')(x), axis=-1)
    x = jnp.concatenate(InceptionE('max', name='Mixed_7c')(x), axis=-1)
    pool = jnp.mean(x, axis=(1, 2))
    logits = nn.Dense(NUM_LOGITS, use_bias=False, precision=_HIGHEST, name='fc')(pool)
    return {'pool': pool, 'logits': logits, 'spatial': spatial.reshape(spatial.shape[0], -1)}


def param_shapes() -> dict:
  """The params tree as ShapeDtypeStructs, traced without computing (what converters and loaders check)."""
  init = lambda: FIDInceptionV3().init(jax.random.key(0), jnp.zeros((1, 1, 1, 3), jnp.float32))
  return jax.eval_shape(init)['params']
