"""pallas_kernels.residual_norm: the gated residual and the next modulated LayerNorm in one kernel,
against its plain-jnp reference (interpret mode, random inputs), its Triton lowering at E-CAR-L's
shapes on the CPU, and clear errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.residual_norm import reference, residual_norm


def _inputs(r, c, k, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(ks[0], (r, c)) * 3 + 1   # a residual stream off zero mean and unit variance
  y = jax.random.normal(ks[1], (r, c)).astype(dtype)
  bias = jax.random.normal(ks[2], (c,)).astype(dtype)
  mod = (0.5 * jax.random.normal(ks[3], (r, k, c))).astype(dtype)
  return x, y, bias, mod


@pytest.mark.parametrize('r,c', [(8, 72), (3, 128), (5, 200)])
def test_kernel_matches_the_reference_in_float32(r, c):
  x, y, bias, mod = _inputs(r, c, 7, jnp.float32)
  got = residual_norm(x, y, bias, mod, (6, 3, 1), eps=1e-6, impl='interpret')
  want = reference(x, y, bias, mod, (6, 3, 1), 1e-6)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_kernel_in_bfloat16_is_within_bfloat16_rounding():
  """The kernel keeps float32 between its operations where the reference rounds to bf16 after
  each, as the flax block does: the two differ by about one bf16 rounding."""
  x, y, bias, mod = _inputs(16, 1152, 4, jnp.bfloat16, seed=1)
  (gx, gh), (wx, wh) = (f(x, y, bias, mod, (2, 0, 1), eps=1e-6, impl=impl) for f, impl in
                        ((residual_norm, 'interpret'), (residual_norm, 'reference')))
  assert gx.dtype == jnp.float32 and gh.dtype == jnp.bfloat16
  rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32)) / jnp.linalg.norm(b))
  assert rel(gx, wx) < 4e-3 and rel(gh, wh) < 1e-2
  assert rel(gh, wh) > 0   # the kernel ran, not the reference


@pytest.mark.parametrize('tokens', [4, 16, 64])
def test_lowers_to_triton_at_e_car_l_shapes_reading_the_adaln_table_in_place(tokens):
  """Triton IR on the CPU (not compiled by Triton here) for E-CAR-L's last denoiser at batch 1
  with guidance: the modulation slices are read by slot from the [R, 50, C] table, not cut out."""
  r, c = 2 * tokens, 1152
  shapes = [jax.ShapeDtypeStruct(s, t) for s, t in (((r, c), jnp.float32), ((r, c), jnp.bfloat16),
                                                    ((c,), jnp.bfloat16), ((r, 50, c), jnp.bfloat16))]
  f = lambda x, y, bias, mod: residual_norm(x, y, bias, mod, (47, 48, 49), eps=1e-6, impl='triton')
  text = jax.jit(f).trace(*shapes).lower(lowering_platforms=('cuda',)).as_text()
  assert 'residual_norm' in text
  assert 'stablehlo.slice' not in text and 'stablehlo.pad' not in text


def test_unsupported_inputs_name_the_misfit():
  x, y, bias, mod = _inputs(4, 32, 3, jnp.bfloat16)
  with pytest.raises(ValueError, match=r'slots \(gate, shift, scale\) must be 3 indices'):
    residual_norm(x, y, bias, mod, (0, 1, 3), eps=1e-6)
  with pytest.raises(ValueError, match='x \\(the residual stream\\) must be float32'):
    residual_norm(x.astype(jnp.bfloat16), y, bias, mod, (0, 1, 2), eps=1e-6)
  with pytest.raises(ValueError, match='mod \\[R, K, C\\] expected'):
    residual_norm(x, y, bias, mod[:, :, :16], (0, 1, 2), eps=1e-6)
  with pytest.raises(ValueError, match='y, bias and mod of one dtype'):
    residual_norm(x, y, bias.astype(jnp.float32), mod, (0, 1, 2), eps=1e-6)
