"""FID, IS and improved precision/recall against closed forms and independent NumPy restatements."""
import numpy as np
import pytest

from train.metrics import (Statistics, feature_statistics, frechet_distance, inception_score, manifold_radii,
                           precision_recall)


def test_frechet_distance_of_commuting_gaussians_matches_the_closed_form():
  rng = np.random.default_rng(0)
  q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
  la, lb = rng.uniform(0.1, 3.0, 6), rng.uniform(0.1, 3.0, 6)
  a = Statistics(rng.standard_normal(6), q @ np.diag(la) @ q.T)
  b = Statistics(rng.standard_normal(6), q @ np.diag(lb) @ q.T)
  want = np.sum((a.mu - b.mu) ** 2) + np.sum(la + lb - 2 * np.sqrt(la * lb))
  assert frechet_distance(a, b) == pytest.approx(want, rel=1e-9)
  assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-9)


def test_feature_statistics_are_the_mean_and_unbiased_covariance():
  x = np.random.default_rng(1).standard_normal((50, 3))
  s = feature_statistics(x)
  np.testing.assert_allclose(s.mu, x.mean(0))
  np.testing.assert_allclose(s.sigma, (x - x.mean(0)).T @ (x - x.mean(0)) / 49)


def test_inception_score_matches_its_definition_per_split():
  rng = np.random.default_rng(2)
  logits = rng.standard_normal((30, 5)) * 2
  p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
  want = []
  for part in (p[:10], p[10:20], p[20:]):
    marginal = part.mean(0)
    want.append(np.exp(np.mean([sum(r[c] * np.log(r[c] / marginal[c]) for c in range(5)) for r in part])))
  assert inception_score(p, split_size=10) == pytest.approx(np.mean(want), rel=1e-12)
  assert inception_score(np.full((8, 4), 0.25)) == pytest.approx(1.0)
  assert inception_score(np.eye(4)[np.arange(8) % 4] * 0.999 + 0.00025) == pytest.approx(4.0, rel=2e-2)


def _brute_pr(ref, gen, k):
  d = lambda a, b: ((a[:, None] - b[None]) ** 2).sum(-1)
  r_ref, r_gen = np.sort(d(ref, ref), 1)[:, k], np.sort(d(gen, gen), 1)[:, k]
  precision = np.mean([(d(g[None], ref)[0] <= r_ref).any() for g in gen])
  recall = np.mean([(d(r[None], gen)[0] <= r_gen).any() for r in ref])
  return precision, recall, r_ref


def test_precision_recall_match_a_brute_force_restatement_in_blocks():
  rng = np.random.default_rng(3)
  ref = rng.standard_normal((40, 8))
  gen = rng.standard_normal((33, 8)) * 1.3 + 0.4
  precision, recall, r_ref = _brute_pr(ref, gen, 3)
  np.testing.assert_allclose(manifold_radii(ref, 3, block=7), r_ref, rtol=1e-4)
  assert precision_recall(ref, gen, 3, block=7) == pytest.approx((precision, recall))
  assert 0 < precision < 1 and 0 < recall < 1
  assert precision_recall(ref, ref, 3, block=16) == (1.0, 1.0)


@pytest.mark.parametrize('call,message', [
    (lambda: feature_statistics(np.zeros((1, 4))), 'features must be'),
    (lambda: frechet_distance(Statistics(np.zeros(2), np.eye(2)), Statistics(np.zeros(3), np.eye(3))),
     'different feature sizes'),
    (lambda: inception_score(np.zeros((4,))), 'probs must be'),
    (lambda: precision_recall(np.zeros((5, 2)), np.zeros((5, 3))), 'one F'),
    (lambda: manifold_radii(np.zeros((3, 2)), k=3), 'k must be'),
])
def test_bad_inputs_are_clear_errors(call, message):
  with pytest.raises(ValueError, match=message):
    call()
