"""The ViT MLP's exact GELU: torch's value on any dtype, and a backward that keeps only its input."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

from var_models.nn.vit import gelu_exact

X = 3 * jax.random.normal(jax.random.key(0), (4, 16, 64))


def test_float32_values_and_gradients_equal_flax_exact_gelu_bit_for_bit():
  flax_gelu = lambda x: nn.gelu(x, approximate=False)
  np.testing.assert_array_equal(gelu_exact(X), flax_gelu(X))
  grad = jax.random.normal(jax.random.key(1), X.shape)
  np.testing.assert_array_equal(jax.vjp(gelu_exact, X)[1](grad)[0], jax.vjp(flax_gelu, X)[1](grad)[0])


def test_bfloat16_is_the_float32_value_rounded_once():
  x = X.astype(jnp.bfloat16)
  got = gelu_exact(x)
  assert got.dtype == jnp.bfloat16
  want = nn.gelu(x.astype(jnp.float32), approximate=False).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  grad = jax.grad(lambda v: gelu_exact(v).astype(jnp.float32).sum())(x)
  want_grad = jax.grad(lambda v: nn.gelu(v, approximate=False).sum())(x.astype(jnp.float32))
  assert grad.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(want_grad.astype(jnp.bfloat16), np.float32))


def test_the_backward_keeps_only_the_input(capsys):
  print_saved_residuals(lambda v: gelu_exact(v).sum(), X.astype(jnp.bfloat16))
  saved = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
  assert saved == ['bf16[4,16,64] from the argument v'], saved
