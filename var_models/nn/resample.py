"""PyTorch-exact image resampling on NHWC arrays.

`jax.image.resize` implements neither PyTorch's 'area' (adaptive average
pooling with integer windows) nor its bicubic (a = -0.75, edge clamping), and
the official checkpoints were trained with those. All three methods here are
separable, so each becomes two small static [out, in] matrices applied along H
and W. The matrices are built in NumPy float32 following PyTorch's CPU
kernels' float arithmetic: source indices always agree, and bicubic weights
agree bit for bit where the size ratio is exact in binary (every VAR and
Infinity schedule); elsewhere they differ by < 1e-6 (PyTorch fuses
multiply-adds).

Accelerators that add a small map onto a larger one take two gather forms instead of the
matmuls: `area_upsample` (each 'area' window of a growing size holds one or two sources) and
`grid_taps` (a grid's flat token positions and weights, for 'bilinear' and 'nearest-exact').
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

METHODS = ('area', 'bicubic', 'nearest')
_CUBIC_A = np.float32(-0.75)


def _check_size(n_in: int, n_out: int) -> None:
  if n_in <= 0 or n_out <= 0:
    raise ValueError(f'resize sizes must be positive, got {n_in} -> {n_out}')


def area_windows(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
  """Adaptive average pooling's windows [start, end) of sources, each [n_out] int:
  start = floor(i * in / out), end = ceil((i + 1) * in / out)."""
  i = np.arange(n_out)
  return (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)


@functools.lru_cache(maxsize=None)
def area_matrix(n_in: int, n_out: int) -> np.ndarray:
  """[n_out, n_in]: adaptive average pooling, each row the mean of its `area_windows` window."""
  _check_size(n_in, n_out)
  m = np.zeros((n_out, n_in), np.float32)
  for i, (start, end) in enumerate(zip(*area_windows(n_in, n_out))):
    m[i, start:end] = np.float32(1.0) / np.float32(end - start)
  return m


def _cubic_weights(t: np.float32) -> tuple[np.float32, ...]:
  a = _CUBIC_A

  def near(x):  # |x| <= 1
    return ((a + 2) * x - (a + 3)) * x * x + 1

  def far(x):  # 1 < |x| < 2
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

  one = np.float32(1.0)
  return far(t + one), near(t), near(one - t), far(np.float32(2.0) - t)


@functools.lru_cache(maxsize=None)
def bicubic_matrix(n_in: int, n_out: int) -> np.ndarray:
  """[n_out, n_in]: bicubic, a = -0.75, align_corners=False, indices clamped."""
  _check_size(n_in, n_out)
  scale = np.float32(n_in) / np.float32(n_out)
  m = np.zeros((n_out, n_in), np.float32)
  for i in range(n_out):
    # PyTorch does not clamp the source coordinate for cubic: it may be < 0.
    src = scale * (np.float32(i) + np.float32(0.5)) - np.float32(0.5)
    i0 = int(np.floor(src))
    t = np.float32(min(max(src - np.float32(i0), 0.0), 1.0))
    for offset, w in zip((-1, 0, 1, 2), _cubic_weights(t)):
      m[i, min(max(i0 + offset, 0), n_in - 1)] += w
  return m


@functools.lru_cache(maxsize=None)
def nearest_matrix(n_in: int, n_out: int) -> np.ndarray:
  """[n_out, n_in]: PyTorch 'nearest' (src = min(floor(dst * in/out), in - 1))."""
  _check_size(n_in, n_out)
  scale = np.float32(n_in) / np.float32(n_out)
  m = np.zeros((n_out, n_in), np.float32)
  for i in range(n_out):
    m[i, min(int(np.floor(np.float32(i) * scale)), n_in - 1)] = 1.0
  return m


_MATRICES = {'area': area_matrix, 'bicubic': bicubic_matrix, 'nearest': nearest_matrix}


def resize(x: jax.Array, hw: tuple[int, int], method: str) -> jax.Array:
  """Resize x [..., H, W, C] to [..., h, w, C] exactly as torch's F.interpolate.

  Identity sizes return x unchanged (PyTorch's kernels are exact identities
  there too).
  """
  if method not in _MATRICES:
    raise ValueError(f'unknown resize method {method!r}; expected one of {METHODS}')
  if x.ndim < 3:
    raise ValueError(f'resize expects [..., H, W, C], got shape {x.shape}')
  h_in, w_in = x.shape[-3], x.shape[-2]
  h, w = int(hw[0]), int(hw[1])
  make = _MATRICES[method]
  if (h, w) != (h_in, w_in):
    mh = jnp.asarray(make(h_in, h), x.dtype)
    mw = jnp.asarray(make(w_in, w), x.dtype)
    x = jnp.einsum('oh,...hwc->...owc', mh, x, precision=jax.lax.Precision.HIGHEST)
    x = jnp.einsum('pw,...owc->...opc', mw, x, precision=jax.lax.Precision.HIGHEST)
  return x


def area_resize(x: jax.Array, hw: tuple[int, int]) -> jax.Array:
  return resize(x, hw, 'area')


def bicubic_resize(x: jax.Array, hw: tuple[int, int]) -> jax.Array:
  return resize(x, hw, 'bicubic')


def nearest_resize(x: jax.Array, hw: tuple[int, int]) -> jax.Array:
  return resize(x, hw, 'nearest')


def area_upsample(x: jax.Array, hw: tuple[int, int]) -> jax.Array:
  """PyTorch 'area' of x [..., H, W, C] to [..., h, w, C], h >= H and w >= W, as gathers: growing a
  side, every window holds one or two sources, and each output is their mean 0.5 (a + b) (b = a
  for one), as adaptive pooling sums and divides; no resampling matmul."""
  if hw[0] < x.shape[-3] or hw[1] < x.shape[-2]:
    raise ValueError(f'area_upsample grows sizes only, got {x.shape[-3:-1]} -> {tuple(hw)}')
  lo, hi = area_windows(x.shape[-3], int(hw[0]))
  x = 0.5 * (x[..., lo, :, :] + x[..., hi - 1, :, :])
  lo, hi = area_windows(x.shape[-2], int(hw[1]))
  return 0.5 * (x[..., lo, :] + x[..., hi - 1, :])


TAP_METHODS = ('bilinear', 'nearest-exact')


def axis_taps(n_in: int, n_out: int, method: str) -> tuple[np.ndarray, np.ndarray]:
  """One axis resampled from n_in to n_out, half-pixel centres c_i = (i + 0.5) n_in / n_out, as taps:
  (sources [n_out, T] int64, weights [n_out, T] float64). 'bilinear' (T = 2): the two sources around
  c_i - 0.5, edges clamped, without antialiasing (PyTorch's bilinear with align_corners=False,
  jax.image.resize's 'linear' with antialias=False); 'nearest-exact' (T = 1): source floor(c_i)
  (jax.image.resize's 'nearest'). Centres and weights are computed in float64."""
  _check_size(n_in, n_out)
  centre = (np.arange(n_out) + 0.5) * n_in / n_out
  if method == 'nearest-exact':
    return np.minimum(np.floor(centre), n_in - 1).astype(np.int64)[:, None], np.ones((n_out, 1))
  if method != 'bilinear':
    raise ValueError(f'unknown tap method {method!r}; expected one of {TAP_METHODS}')
  lo = np.floor(centre - 0.5)
  frac = centre - 0.5 - lo
  sources = np.clip(np.stack([lo, lo + 1], -1), 0, n_in - 1).astype(np.int64)
  return sources, np.stack([1 - frac, frac], -1)


def grid_taps(n_in: int, n_out: int, method: str) -> tuple[np.ndarray, np.ndarray]:
  """An n_in x n_in grid resampled onto n_out x n_out by `axis_taps` on both axes, on tokens in raster
  order: (rows [n_out * n_out, T * T] int32, the flat source positions of each output token;
  weights [n_out * n_out, T * T] float32, products of the axes' weights rounded once)."""
  sources, w = axis_taps(n_in, n_out, method)
  t = sources.shape[1]
  rows = sources[:, None, :, None] * n_in + sources[None, :, None, :]   # [n_out, n_out, T, T]
  weights = w[:, None, :, None] * w[None, :, None, :]
  return rows.reshape(n_out * n_out, t * t).astype(np.int32), weights.reshape(n_out * n_out, t * t).astype(np.float32)
