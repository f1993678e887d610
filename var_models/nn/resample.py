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


@functools.lru_cache(maxsize=None)
def area_matrix(n_in: int, n_out: int) -> np.ndarray:
  """[n_out, n_in]: adaptive average pooling, window [floor(i*in/out), ceil((i+1)*in/out))."""
  _check_size(n_in, n_out)
  m = np.zeros((n_out, n_in), np.float32)
  for i in range(n_out):
    start = (i * n_in) // n_out
    end = -((-(i + 1) * n_in) // n_out)
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
