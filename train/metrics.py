"""Sample-quality metrics with the semantics of ADM's evaluator (guided-diffusion, evaluations/evaluator.py),
the one every paper of this project reports with.

  stats = feature_statistics(pool)                     # pool [N, 2048] float
  fid = frechet_distance(stats, ref_stats)             # FID (pool features) or sFID (spatial)
  inception_score(probs)                               # probs [N, classes], softmax of the logits
  precision, recall = precision_recall(ref, samples)   # improved precision / recall, k = 3

Statistics are float64 means and unbiased covariances (np.cov); the Frechet distance takes
scipy's matrix square root of sigma1 sigma2 and, if it is not finite, retries with 1e-6 added
to both diagonals, and drops an imaginary part only if the diagonal's is below 1e-3 (ADM's rule).
The Inception Score averages exp(E KL(p(y|x) || p(y))) over consecutive splits of `split_size`
samples (5000: 10 splits of 50,000). Precision and recall (Kynkaanniemi et al. 2019): each
feature's radius is its squared L2 distance to its k-th nearest neighbour in its own set (the
zero distance to itself not counted), a sample is in the reference manifold if it lies within
some reference feature's radius (<=), and vice versa; distances are computed on the device in
[row, col] blocks, so 50k x 50k never exists at once.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import linalg


class Statistics(NamedTuple):
  mu: np.ndarray      # [F]
  sigma: np.ndarray   # [F, F]


def feature_statistics(features) -> Statistics:
  """Mean and unbiased covariance of features [N, F] (float64)."""
  x = np.asarray(features, np.float64)
  if x.ndim != 2 or len(x) < 2:
    raise ValueError(f'features must be [N >= 2, F], got {x.shape}')
  return Statistics(x.mean(axis=0), np.cov(x, rowvar=False))


def frechet_distance(a: Statistics, b: Statistics, eps: float = 1e-6) -> float:
  """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2))."""
  if a.mu.shape != b.mu.shape or a.sigma.shape != b.sigma.shape:
    raise ValueError(f'statistics of different feature sizes: {a.mu.shape} and {b.mu.shape}')
  diff = a.mu - b.mu
  covmean = linalg.sqrtm(a.sigma.dot(b.sigma))
  if not np.isfinite(covmean).all():
    offset = np.eye(len(a.mu)) * eps
    covmean = linalg.sqrtm((a.sigma + offset).dot(b.sigma + offset))
  if np.iscomplexobj(covmean):
    if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
      raise ValueError(f'the matrix square root has an imaginary diagonal up to {np.abs(covmean.imag).max():.3g}')
    covmean = covmean.real
  return float(diff.dot(diff) + np.trace(a.sigma) + np.trace(b.sigma) - 2 * np.trace(covmean))


def inception_score(probs, split_size: int = 5000) -> float:
  """Mean over splits of exp(mean_x KL(p(y|x) || p(y))); probs [N, classes] rows summing to 1."""
  p = np.asarray(probs, np.float64)
  if p.ndim != 2 or not len(p):
    raise ValueError(f'probs must be [N, classes], got {p.shape}')
  scores = []
  for i in range(0, len(p), split_size):
    part = p[i:i + split_size]
    py = part.mean(axis=0, keepdims=True)
    scores.append(np.exp(np.mean(np.sum(part * (np.log(part) - np.log(py)), axis=1))))
  return float(np.mean(scores))


@jax.jit
def _sq_distances(u, v):
  """[n, F], [m, F] -> [n, m] squared L2 distances, float32, clamped at 0 (ADM's formula)."""
  nu, nv = jnp.sum(u * u, axis=1)[:, None], jnp.sum(v * v, axis=1)[None, :]
  return jnp.maximum(nu - 2 * (u @ v.T) + nv, 0.0)


def _blocks(n: int, size: int):
  return [(i, min(i + size, n)) for i in range(0, n, size)]


def manifold_radii(features, k: int = 3, block: int = 10000) -> np.ndarray:
  """[N] squared distance of each feature to its k-th nearest neighbour in the set."""
  x = jnp.asarray(features, jnp.float32)
  if not 0 < k < len(x):
    raise ValueError(f'k must be in [1, {len(x) - 1}], got {k}')
  radii = []
  for r0, r1 in _blocks(len(x), block):
    best = None   # the k + 1 smallest distances of the rows so far (the first is the row's own 0)
    for c0, c1 in _blocks(len(x), block):
      d = -jax.lax.top_k(-_sq_distances(x[r0:r1], x[c0:c1]), min(k + 1, c1 - c0))[0]
      best = d if best is None else -jax.lax.top_k(-jnp.concatenate([best, d], 1), k + 1)[0]
    radii.append(np.asarray(best[:, k]))
  return np.concatenate(radii)


def _within(a, radii_b, b, block: int) -> np.ndarray:
  """[len(a)] bool: whether each row of a lies within some row of b's radius."""
  out = []
  for r0, r1 in _blocks(len(a), block):
    hit = jnp.zeros((r1 - r0,), bool)
    for c0, c1 in _blocks(len(b), block):
      hit |= jnp.any(_sq_distances(a[r0:r1], b[c0:c1]) <= radii_b[None, c0:c1], axis=1)
    out.append(np.asarray(hit))
  return np.concatenate(out)


def precision_recall(reference, samples, k: int = 3, block: int = 10000) -> tuple[float, float]:
  """(precision: samples inside the reference manifold, recall: reference inside the samples')."""
  ref, gen = (jnp.asarray(f, jnp.float32) for f in (reference, samples))
  if ref.ndim != 2 or ref.shape[1:] != gen.shape[1:]:
    raise ValueError(f'reference and samples must be [N, F] of one F, got {ref.shape}, {gen.shape}')
  r_ref, r_gen = (jnp.asarray(manifold_radii(f, k, block)) for f in (ref, gen))
  precision = float(_within(gen, r_ref, ref, block).mean())
  recall = float(_within(ref, r_gen, gen, block).mean())
  return precision, recall
