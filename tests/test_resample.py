"""var_models.nn.resample against independent float64 NumPy references of PyTorch's kernels.

The references below are written from PyTorch's documented semantics, computing
each output pixel directly from its 2-D neighbourhood; they do not reuse the
module's separable matrices.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from var_models.nn import resample

RTOL = 2e-6
ATOL = 2e-6


def _input(shape, seed=0):
  """Random float32 input bounded away from zero (never all zeros / trivial)."""
  rng = np.random.default_rng(seed)
  sign = rng.choice([-1.0, 1.0], size=shape)
  return (sign * rng.uniform(0.25, 2.0, size=shape)).astype(np.float32)


# ----------------------------------------------------------- float64 references
def ref_area(x, hw):
  """adaptive_avg_pool2d: window [floor(i*in/out), ceil((i+1)*in/out))."""
  x = np.asarray(x, np.float64)
  h_in, w_in = x.shape[-3], x.shape[-2]
  h, w = hw
  out = np.empty(x.shape[:-3] + (h, w, x.shape[-1]), np.float64)
  for i in range(h):
    y0, y1 = math.floor(i * h_in / h), math.ceil((i + 1) * h_in / h)
    for j in range(w):
      x0, x1 = math.floor(j * w_in / w), math.ceil((j + 1) * w_in / w)
      out[..., i, j, :] = x[..., y0:y1, x0:x1, :].mean(axis=(-3, -2))
  return out


def _cubic(d, a=-0.75):
  """Keys' cubic convolution kernel at distance d."""
  d = abs(d)
  if d <= 1:
    return (a + 2) * d ** 3 - (a + 3) * d ** 2 + 1
  if d < 2:
    return a * d ** 3 - 5 * a * d ** 2 + 8 * a * d - 4 * a
  return 0.0


def _cubic_taps(dst, n_in, n_out, coord_dtype=np.float32):
  """[(index, weight)] x4 for one output coordinate, align_corners=False.

  PyTorch computes the source coordinate of a float32 tensor in float32
  (scale = float(in) / out; src = scale * (dst + 0.5) - 0.5); coord_dtype
  reproduces that rounding (float32) or uses the exact coordinate (float64).
  Weights and sums are float64 either way.
  """
  c = coord_dtype
  src = c(c(n_in) / c(n_out)) * (c(dst) + c(0.5)) - c(0.5)  # not clamped below 0 for cubic
  src = float(src)
  base = math.floor(src)
  t = src - base
  taps = []
  for off in (-1, 0, 1, 2):
    taps.append((min(max(base + off, 0), n_in - 1), _cubic(t - off)))
  return taps


def ref_bicubic(x, hw, coord_dtype=np.float32):
  x = np.asarray(x, np.float64)
  h_in, w_in = x.shape[-3], x.shape[-2]
  h, w = hw
  out = np.zeros(x.shape[:-3] + (h, w, x.shape[-1]), np.float64)
  for i in range(h):
    ty = _cubic_taps(i, h_in, h, coord_dtype)
    for j in range(w):
      tx = _cubic_taps(j, w_in, w, coord_dtype)
      acc = 0.0
      for yi, wy in ty:
        for xi, wx in tx:
          acc = acc + wy * wx * x[..., yi, xi, :]
      out[..., i, j, :] = acc
  return out


def ref_nearest(x, hw):
  x = np.asarray(x, np.float64)
  h_in, w_in = x.shape[-3], x.shape[-2]
  h, w = hw
  out = np.empty(x.shape[:-3] + (h, w, x.shape[-1]), np.float64)
  for i in range(h):
    yi = min((i * h_in) // h, h_in - 1)
    for j in range(w):
      xi = min((j * w_in) // w, w_in - 1)
      out[..., i, j, :] = x[..., yi, xi, :]
  return out


REFS = {'area': ref_area, 'bicubic': ref_bicubic, 'nearest': ref_nearest}


def _check(method, in_hw, out_hw, lead=(2,), channels=3, seed=0):
  x = _input(lead + tuple(in_hw) + (channels,), seed)
  got = resample.resize(jnp.asarray(x), out_hw, method)
  assert got.shape == lead + tuple(out_hw) + (channels,)
  assert got.dtype == jnp.float32
  want = REFS[method](x, out_hw)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=RTOL, atol=ATOL)
  return x, got, want


# ------------------------------------------------------------------- reference sanity
def test_cubic_kernel_reference_is_partition_of_unity():
  # Guards the reference itself: the 4 taps of Keys' kernel always sum to 1.
  for n_in, n_out in [(3, 16), (13, 16), (16, 8), (9, 14)]:
    for dst in range(n_out):
      for c in (np.float32, np.float64):
        assert sum(w for _, w in _cubic_taps(dst, n_in, n_out, c)) == pytest.approx(1.0, abs=1e-12)


# ------------------------------------------------------------------- area
@pytest.mark.parametrize('n_in,n_out', [(16, 13), (16, 1), (16, 5), (7, 3), (13, 16)])
def test_area_matches_adaptive_avg_pool_reference(n_in, n_out):
  _check('area', (n_in, n_in), (n_out, n_out))


def test_area_non_square_12x9_to_5x4():
  _check('area', (12, 9), (5, 4))


def test_area_to_1x1_is_global_mean():
  x, got, _ = _check('area', (16, 16), (1, 1))
  np.testing.assert_allclose(np.asarray(got)[:, 0, 0], x.astype(np.float64).mean(axis=(1, 2)),
                             rtol=RTOL, atol=ATOL)


def test_area_windows_overlap_when_not_divisible():
  # 7 -> 3: windows [0,3), [2,5), [4,7): output 1 averages rows 2..4 (not 2..3).
  x = _input((1, 7, 1, 1), seed=3)
  got = np.asarray(resample.area_resize(jnp.asarray(x), (3, 1)))
  np.testing.assert_allclose(got[0, 1, 0, 0], x[0, 2:5, 0, 0].astype(np.float64).mean(),
                             rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------- bicubic
@pytest.mark.parametrize('n_in,n_out', [(1, 16), (2, 16), (3, 16), (13, 16), (16, 16), (16, 8)])
def test_bicubic_matches_pytorch_reference(n_in, n_out):
  _check('bicubic', (n_in, n_in), (n_out, n_out))


def test_bicubic_non_square():
  _check('bicubic', (12, 9), (5, 14))


def test_bicubic_close_to_exact_float64_coordinates():
  # With the source coordinate computed exactly (not in PyTorch's float32), the
  # result differs only by float32 coordinate rounding: ~ulp(src) * |kernel'|.
  x = _input((2, 12, 9, 3), seed=4)
  got = np.asarray(resample.bicubic_resize(jnp.asarray(x), (5, 14)), np.float64)
  np.testing.assert_allclose(got, ref_bicubic(x, (5, 14), coord_dtype=np.float64),
                             rtol=1e-5, atol=1e-5)


def test_bicubic_identity_size_is_exact():
  x = _input((2, 16, 16, 3), seed=5)
  got = resample.bicubic_resize(jnp.asarray(x), (16, 16))
  np.testing.assert_array_equal(np.asarray(got), x)


def test_bicubic_from_1_pixel_is_constant():
  x = _input((2, 1, 1, 3), seed=6)
  got = np.asarray(resample.bicubic_resize(jnp.asarray(x), (16, 16)))
  np.testing.assert_allclose(got, np.broadcast_to(x, got.shape), rtol=RTOL, atol=ATOL)


def test_bicubic_overshoots_unlike_bilinear():
  # A = -0.75 gives negative lobes: a step edge upsampled overshoots its range,
  # which a clamped or bilinear implementation would not do.
  x = np.zeros((1, 4, 1, 1), np.float32)
  x[0, 2:] = 1.0
  x += 0.5  # keep the input non-zero
  got = np.asarray(resample.bicubic_resize(jnp.asarray(x), (16, 1)))
  assert got.max() > 1.5 + 1e-3 and got.min() < 0.5 - 1e-3
  np.testing.assert_allclose(got, ref_bicubic(x, (16, 1)), rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------- nearest
@pytest.mark.parametrize('n_in,n_out', [(3, 7), (2, 16), (16, 5)])
def test_nearest_matches_pytorch_reference(n_in, n_out):
  _check('nearest', (n_in, n_in), (n_out, n_out))


def test_nearest_non_square():
  _check('nearest', (12, 9), (5, 4))


def test_nearest_3_to_7_picks_floor_indices():
  # src = floor(dst * 3/7): 0,0,0,1,1,2,2 (not round-half, not align_corners).
  x = np.arange(1, 4, dtype=np.float32).reshape(1, 3, 1, 1)
  got = np.asarray(resample.nearest_resize(jnp.asarray(x), (7, 1)))[0, :, 0, 0]
  np.testing.assert_array_equal(got, np.array([1, 1, 1, 2, 2, 3, 3], np.float32))


# ------------------------------------------------------------------- shapes, api, jit
@pytest.mark.parametrize('method', resample.METHODS)
def test_leading_dims_and_channels_preserved_and_independent(method):
  # Extra leading dims [2, 3, H, W, 4]: each (batch, channel) is resized on its own.
  _check(method, (9, 7), (5, 11), lead=(2, 3), channels=4, seed=11)


@pytest.mark.parametrize('method', resample.METHODS)
def test_unbatched_hwc_input(method):
  _check(method, (6, 5), (4, 8), lead=(), channels=2, seed=12)


def test_wrappers_equal_resize():
  x = jnp.asarray(_input((2, 13, 13, 3), seed=7))
  for method, fn in [('area', resample.area_resize), ('bicubic', resample.bicubic_resize),
                     ('nearest', resample.nearest_resize)]:
    np.testing.assert_array_equal(np.asarray(fn(x, (16, 16))),
                                  np.asarray(resample.resize(x, (16, 16), method)))


def test_unknown_method_raises_value_error():
  x = jnp.ones((1, 4, 4, 1))
  with pytest.raises(ValueError, match='bilinear'):
    resample.resize(x, (2, 2), 'bilinear')


@pytest.mark.parametrize('shape', [(4, 4), (4,)])
def test_too_few_dims_raises_value_error(shape):
  with pytest.raises(ValueError):
    resample.resize(jnp.ones(shape), (2, 2), 'area')


@pytest.mark.parametrize('method', resample.METHODS)
@pytest.mark.parametrize('hw', [(0, 4), (4, -1)])
def test_non_positive_size_raises_value_error(method, hw):
  with pytest.raises(ValueError):
    resample.resize(jnp.ones((1, 4, 4, 1)), hw, method)


@pytest.mark.parametrize('method', resample.METHODS)
def test_jit_matches_eager(method):
  x = jnp.asarray(_input((2, 13, 9, 3), seed=8))
  fn = jax.jit(resample.resize, static_argnums=(1, 2))
  got = fn(x, (16, 5), method)
  np.testing.assert_allclose(np.asarray(got), np.asarray(resample.resize(x, (16, 5), method)),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got, np.float64), REFS[method](np.asarray(x), (16, 5)),
                             rtol=RTOL, atol=ATOL)


def test_jit_inside_larger_function_and_grad():
  # Resize used in a traced loss: gradients flow (matrices are static constants).
  x = jnp.asarray(_input((1, 8, 8, 2), seed=9))

  def loss(x):
    return jnp.sum(resample.area_resize(x, (4, 4)) ** 2)

  g = jax.jit(jax.grad(loss))(x)
  # d/dx of sum(avgpool2x2(x)^2) = 2 * pooled / 4, broadcast back onto each window.
  pooled = np.asarray(x, np.float64).reshape(1, 4, 2, 4, 2, 2).mean(axis=(2, 4))
  want = np.repeat(np.repeat(2 * pooled / 4, 2, axis=1), 2, axis=2)
  np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('n_in,n_out', [(2, 3), (24, 32), (24, 40), (36, 48), (10, 13), (10, 16), (5, 5)])
def test_area_upsampling_by_gathers_equals_the_resampling_matrices(n_in, n_out):
  x = jax.random.normal(jax.random.key(n_out), (2, n_in, n_in, 3))
  np.testing.assert_allclose(resample.area_upsample(x, (n_out, n_out)), resample.area_resize(x, (n_out, n_out)),
                             rtol=1e-6, atol=1e-6)


def test_area_upsample_refuses_to_shrink():
  with pytest.raises(ValueError, match='grows sizes only'):
    resample.area_upsample(jnp.ones((1, 4, 4, 1)), (3, 4))


@pytest.mark.parametrize('n_in,n_out', [(3, 3), (4, 6), (10, 13), (6, 4)])
@pytest.mark.parametrize('method,jax_method', [('bilinear', 'linear'), ('nearest-exact', 'nearest')])
def test_grid_taps_resample_as_jax_image_resize_without_antialiasing(n_in, n_out, method, jax_method):
  x = _input((2, n_in, n_in, 3), seed=n_out)
  rows, weights = resample.grid_taps(n_in, n_out, method)
  got = np.einsum('lt,bltc->blc', weights, x.reshape(2, n_in * n_in, 3)[:, rows])
  want = jax.image.resize(x, (2, n_out, n_out, 3), jax_method, antialias=False)
  np.testing.assert_allclose(got, np.asarray(want).reshape(2, n_out * n_out, 3), rtol=1e-5, atol=1e-5)
