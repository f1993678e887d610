"""pallas_kernels.layer_norm: one layer of stacked LayerNorm parameters applied in place; its reference
against flax's LayerNorm, the kernel against the reference on random inputs in interpret mode, and a
scanned block's LayerNorms routed to it."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import layer_norm
from pallas_kernels.layer_norm import reference
from var_models.nn import scan as scan_module
from var_models.nn.vit import Block

EPS = 1e-6


def _inputs(shape, layers=3, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(shape[-1] + len(shape)), 3)
  # An offset mean, as deep residual streams have: the variance must be the two-pass one.
  x = (3 + 2 * jax.random.normal(keys[0], shape)).astype(dtype)
  scale = 1 + jax.random.normal(keys[1], (layers, shape[-1]))
  shift = jax.random.normal(keys[2], (layers, shape[-1]))
  return x, scale, shift


@pytest.mark.parametrize('x_dtype,dtype', [(jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, jnp.bfloat16)])
def test_reference_is_flax_layer_norm_bit_for_bit_at_a_traced_layer(x_dtype, dtype):
  x, scale, shift = _inputs((2, 5, 96), dtype=x_dtype)
  flax_norm = nn.LayerNorm(epsilon=EPS, use_fast_variance=False, dtype=dtype)

  def step(_, i):
    params = {'scale': scale[i], 'bias': shift[i]}
    return None, (flax_norm.apply({'params': params}, x), reference(x, scale, shift, i, EPS, dtype))
  _, (want, got) = jax.lax.scan(step, None, jnp.arange(3))
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize('c', [1280, 768, 64, 8192])   # 2, 4, 64 and 1 rows a program
@pytest.mark.parametrize('x_dtype,dtype,tol', [(jnp.float32, None, 1e-5), (jnp.bfloat16, jnp.bfloat16, 1e-2)])
def test_kernel_reads_the_named_layer_of_the_stacks(c, x_dtype, dtype, tol):
  x, scale, shift = _inputs((3, 13, c), dtype=x_dtype)   # 39 rows: the last row block overhangs
  run = jax.jit(lambda i: layer_norm(x, scale, shift, i, eps=EPS, dtype=dtype, impl='interpret'))
  for layer in (0, 2):
    got, want = run(jnp.int32(layer)), reference(x, scale, shift, layer, EPS, dtype)
    assert got.dtype == want.dtype and got.shape == x.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_auto_on_a_cpu_is_the_reference():
  x, scale, shift = _inputs((7, 768))
  np.testing.assert_array_equal(layer_norm(x, scale, shift, 1, eps=EPS), reference(x, scale, shift, 1, EPS))


def test_bad_shapes_name_the_problem():
  x, scale, shift = _inputs((4, 64))
  with pytest.raises(ValueError, match=r'x \[\.\.\., C\], scale and shift \[L, C\]; got \(4, 64\), \(64,\)'):
    layer_norm(x, scale[0], shift, 0, eps=EPS)
  with pytest.raises(ValueError, match=r'got \(4, 48\), \(3, 64\), \(3, 64\)'):
    layer_norm(x[:, :48], scale, shift, 0, eps=EPS)
  with pytest.raises(ValueError, match='C=24 is not a multiple of 16'):
    layer_norm(x[:, :24], scale[:, :24], shift[:, :24], 0, eps=EPS, impl='interpret')


class _Blocks(nn.Module):
  """Three ViT blocks, run one after the other or as one scan."""
  def setup(self):
    self.blocks = [Block(64, 2) for _ in range(3)]

  def __call__(self, x, scan: bool):
    if not scan:
      for block in self.blocks:
        x = block(x)[0]
      return x
    return scan_module.scan_blocks(self.blocks, range(3), x, None, lambda block, i, h, _: (block(h)[0], None))[0]


def test_a_scanned_blocks_layer_norms_read_their_stacked_parameters(monkeypatch):
  stacks = []

  def spy(x, scale, shift, layer, **kw):
    stacks.append(scale.shape)
    return layer_norm(x, scale, shift, layer, **kw)
  monkeypatch.setattr(scan_module.pk, 'layer_norm', spy)
  x = 1 + jax.random.normal(jax.random.key(0), (2, 5, 64))
  params = _Blocks().init(jax.random.key(1), x, False)
  params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape), params)
  unrolled = _Blocks().apply(params, x, False)
  with pk.override('interpret'):
    scanned = _Blocks().apply(params, x, True)
  assert stacks == [(3, 64), (3, 64)]    # norm1 and norm2, traced once
  np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)
