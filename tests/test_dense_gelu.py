"""Dense + tanh-GELU: the reference is flax's Dense + jax.nn.gelu; the Mosaic GPU kernel
(Hopper only) matches a float64 reference, values and gradients."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dense_gelu
from pallas_kernels.dispatch import is_hopper
from var_models.nn.blocks import FFN


def _inputs(seed, m, k, n, dtype):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((m, k)), dtype),
          jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype),
          jnp.asarray(rng.standard_normal(n) * 0.5, dtype))


def test_reference_equals_flax_dense_then_gelu():
  x = jax.random.normal(jax.random.key(0), (2, 5, 16), jnp.bfloat16)
  dense = nn.Dense(32, dtype=jnp.bfloat16)
  params = dense.init(jax.random.key(1), x)
  want = jax.nn.gelu(dense.apply(params, x), approximate=True)
  p = {k: v.astype(jnp.bfloat16) for k, v in params['params'].items()}
  got = dense_gelu(x, p['kernel'], p['bias'])  # on the CPU, 'auto' is the reference
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_ffn_keeps_dense_parameters_and_value_in_both_modes():
  x = jax.random.normal(jax.random.key(0), (2, 7, 16), jnp.bfloat16)
  ffn = FFN(16, 64, nn.initializers.normal(0.5), nn.initializers.normal(0.5), dtype=jnp.bfloat16)
  params = ffn.init(jax.random.key(1), x)
  p = params['params']
  assert jax.tree.map(jnp.shape, p) == {'fc1': {'kernel': (16, 64), 'bias': (64,)},
                                        'fc2': {'kernel': (64, 16), 'bias': (16,)}}
  p = {'fc1': {**p['fc1'], 'bias': jax.random.normal(jax.random.key(2), (64,))}, 'fc2': p['fc2']}
  dense = lambda n, q, h: nn.Dense(n, dtype=jnp.bfloat16).apply({'params': q}, h)
  want = dense(16, p['fc2'], jax.nn.gelu(dense(64, p['fc1'], x), approximate=True))
  for deterministic in (True, False):
    got = ffn.apply({'params': p}, x, deterministic=deterministic)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_bad_arguments_raise_clear_errors():
  x, w, b = _inputs(0, 4, 64, 256, jnp.float32)
  with pytest.raises(ValueError, match='x \\[..., K\\], w \\[K, N\\], b \\[N\\]'):
    dense_gelu(x, w[:32], b)
  with pytest.raises(ValueError, match="no 'triton' kernel"):
    dense_gelu(x, w, b, impl='triton')
  with pytest.raises(ValueError, match="impl='mosaic'.*bfloat16 or float16"):
    dense_gelu(x, w, b, impl='mosaic')


@pytest.mark.skipif(not is_hopper(), reason='the Mosaic GPU kernel runs on Hopper GPUs only')
@pytest.mark.parametrize('m, k, n', [(384, 192, 512), (1024, 128, 256)])
def test_mosaic_kernel_matches_float64_reference_values_and_gradients(m, k, n):
  x, w, b = _inputs(1, m, k, n, jnp.bfloat16)
  g = jnp.asarray(np.random.default_rng(2).standard_normal((m, n)), jnp.bfloat16)
  out, vjp = jax.vjp(lambda *a: dense_gelu(*a, impl='mosaic'), x, w, b)
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, w, b)]
    ref, ref_vjp = jax.vjp(lambda x, w, b: jax.nn.gelu(x @ w + b, approximate=True), *args)
    ref_grads = ref_vjp(jnp.asarray(np.asarray(g, np.float64)))
  rel = lambda a, r: np.linalg.norm(np.asarray(a, np.float64) - r) / np.linalg.norm(r)
  assert rel(out, ref) < 1e-2
  for got, want in zip(vjp(g), ref_grads):
    assert rel(got, want) < 2e-2
