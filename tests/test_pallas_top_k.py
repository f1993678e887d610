"""Top-k selection (Pallas, interpret mode) against lax.top_k's set."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels.top_k import order_keys, top_k_indices


@pytest.mark.parametrize('shape, k', [((3, 4121), 824), ((2, 5, 37), 5), ((4, 16), 16), ((4, 100), 1)])
def test_top_k_indices_is_lax_top_ks_set_in_index_order(shape, k):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  got = top_k_indices(x, k, impl='interpret')
  assert got.shape == shape[:-1] + (k,) and got.dtype == jnp.int32
  np.testing.assert_array_equal(got, reference.top_k_indices(x, k))
  assert (np.diff(np.asarray(got), axis=-1) > 0).all()


def test_top_k_indices_breaks_ties_to_the_lower_index_across_signs():
  rng = np.random.default_rng(1)
  x = rng.integers(-3, 4, (6, 300)).astype(np.float32)   # many ties, both signs
  x[0] = 2.0                                              # one row all equal
  for k in (1, 7, 150, 300):
    np.testing.assert_array_equal(top_k_indices(jnp.asarray(x), k, impl='interpret'),
                                  reference.top_k_indices(jnp.asarray(x), k))
  np.testing.assert_array_equal(top_k_indices(jnp.asarray(x), 4, impl='interpret')[0], [0, 1, 2, 3])


def test_order_keys_preserve_the_order_of_floats():
  x = np.array([-np.inf, -3.5, -1e-30, 0.0, 1e-30, 2.0, np.inf], np.float32)
  assert (np.diff(np.asarray(order_keys(jnp.asarray(x)))) > 0).all()


@pytest.mark.parametrize('x, k, match', [
    (jnp.zeros((2, 8)), 0, 'k=0'),
    (jnp.zeros((2, 8)), 9, 'k=9'),
    (jnp.zeros((2, 8), jnp.int32), 2, 'float'),
])
def test_top_k_indices_rejects_bad_input_by_name(x, k, match):
  with pytest.raises(ValueError, match=match):
    top_k_indices(x, k, impl='interpret')
