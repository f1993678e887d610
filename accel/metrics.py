"""Fidelity of an accelerated sampler's images to the baseline's: PSNR, SSIM, LPIPS, token agreement.

Images are float [N, H, W, 3] in [0, 1]; every metric is per image, the baseline image the reference.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from var_models import checkpoint
from var_models.tokenizers import lpips as lpips_lib

# SSIM as Wang et al. (2004) define it: 11 x 11 Gaussian window of sigma 1.5, K1 0.01, K2 0.03,
# data range 1, only windows that fit in the image, mean over positions and channels.
SSIM_WINDOW, SSIM_SIGMA, SSIM_K1, SSIM_K2 = 11, 1.5, 0.01, 0.03


def psnr(ref: np.ndarray, img: np.ndarray) -> np.ndarray:
  """[N] dB; inf where the images are equal."""
  mse = np.mean(np.square(ref.astype(np.float64) - img.astype(np.float64)), axis=(1, 2, 3))
  with np.errstate(divide='ignore'):
    return 10 * np.log10(1.0 / mse)


@functools.lru_cache(maxsize=None)
def _window_matrix(n: int) -> np.ndarray:
  """[n - W + 1, n]: each row the normalised 1-D Gaussian over one fitting window."""
  t = np.arange(SSIM_WINDOW) - (SSIM_WINDOW - 1) / 2
  g = np.exp(-t ** 2 / (2 * SSIM_SIGMA ** 2))
  g /= g.sum()
  m = np.zeros((n - SSIM_WINDOW + 1, n))
  for i in range(m.shape[0]):
    m[i, i:i + SSIM_WINDOW] = g
  return m


@jax.jit
def _ssim(ref: jax.Array, img: jax.Array) -> jax.Array:
  h, w = ref.shape[1:3]
  mh, mw = jnp.asarray(_window_matrix(h), jnp.float32), jnp.asarray(_window_matrix(w), jnp.float32)
  blur = lambda x: jnp.einsum('ph,qw,nhwc->npqc', mh, mw, x, precision=jax.lax.Precision.HIGHEST)
  mu_x, mu_y = blur(ref), blur(img)
  var_x = blur(ref * ref) - mu_x ** 2
  var_y = blur(img * img) - mu_y ** 2
  cov = blur(ref * img) - mu_x * mu_y
  c1, c2 = SSIM_K1 ** 2, SSIM_K2 ** 2
  s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
  return jnp.mean(s, axis=(1, 2, 3))


def ssim(ref: np.ndarray, img: np.ndarray) -> np.ndarray:
  """[N] in [-1, 1]; 1 where the images are equal. Images of at least 11 x 11 px."""
  if min(ref.shape[1:3]) < SSIM_WINDOW:
    raise ValueError(f'SSIM needs images of at least {SSIM_WINDOW} px, got {ref.shape}')
  return np.asarray(_ssim(jnp.asarray(ref, jnp.float32), jnp.asarray(img, jnp.float32)))


def load_lpips(directory: str) -> Any:
  """LPIPS params from a `python -m var_models.convert lpips` directory."""
  img = jnp.zeros((1, lpips_lib.MIN_SIZE, lpips_lib.MIN_SIZE, 3), jnp.float32)
  abstract = jax.eval_shape(lambda k: lpips_lib.LPIPS().init(k, img, img)['params'], jax.random.key(0))
  return checkpoint.load_params(directory, {'lpips': abstract})['lpips']


def lpips(params: Any, ref: np.ndarray, img: np.ndarray, batch: int = 16) -> np.ndarray:
  """[N] LPIPS (vgg, v0.1) distances, float32 compute."""
  dist = jax.jit(lambda p, x, y: lpips_lib.LPIPS().apply({'params': p}, x * 2 - 1, y * 2 - 1))
  out = [dist(params, jnp.asarray(ref[i:i + batch]), jnp.asarray(img[i:i + batch]))
         for i in range(0, len(ref), batch)]
  return np.concatenate([np.asarray(o) for o in out])


def token_agreement(ref: Sequence[np.ndarray], other: Sequence[np.ndarray]) -> list[float]:
  """Per scale both samplers ran (the shorter list), the fraction of equal token ids."""
  return [float(np.mean(np.asarray(a) == np.asarray(b))) for a, b in zip(ref, other)]


def summarise(ref: np.ndarray, img: np.ndarray, lpips_params: Optional[Any] = None) -> dict:
  """Per-image PSNR, SSIM (and LPIPS) of img against ref: {'psnr': [N], 'ssim': [N], 'lpips': [N] | None}."""
  return {'psnr': psnr(ref, img), 'ssim': ssim(ref, img),
          'lpips': None if lpips_params is None else lpips(lpips_params, ref, img)}
