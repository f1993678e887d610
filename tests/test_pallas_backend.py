"""The models' attention entry point with backend='pallas' (kernels in interpret mode)
equals backend='xla', values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from var_models.nn.attention import ScaleCausal, TokenMask, attention
from var_models.var.schedules import ScaleSchedule

SCHED = ScaleSchedule((1, 2, 3, 5))   # L = 39: not a multiple of the 64-token tile
LEVELS = SCHED.level_ids()


def _qkv(seed, lq=39, lk=39, h=2, d=16):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal((2, n, h, d)), jnp.float32) for n in (lq, lk, lk))


def _both(q, k, v, **kw):
  with pallas_kernels.override('interpret'):
    got = attention(q, k, v, backend='pallas', **kw)
  return got, attention(q, k, v, backend='xla', **kw)


@pytest.mark.parametrize('mask', [None, ScaleCausal(LEVELS, LEVELS)], ids=['none', 'scale_causal'])
def test_pallas_backend_equals_xla(mask):
  got, want = _both(*_qkv(0), mask=mask)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_pallas_backend_unmasked_runs_the_few_token_kernel_up_to_its_limit_then_the_block_sparse_kernel():
  lowered = lambda *a: jax.jit(lambda q, k, v: attention(q, k, v, backend='pallas')).trace(*a).lower(
      lowering_platforms=('cuda',)).as_text()
  longer = jax.ShapeDtypeStruct((2, 520, 2, 32), jnp.float32)   # past few_token_attention's 512 tokens
  q, k, v = _qkv(6, lq=150, lk=150)
  with pallas_kernels.override('triton'):
    text, long_text = lowered(q, k, v), lowered(longer, longer, longer)
  assert 'few_token_attention' in text and 'block_sparse_attention_fwd' not in text
  assert 'block_sparse_attention_fwd' in long_text and 'few_token_attention' not in long_text
  got, want = _both(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_pallas_backend_scale_causal_last_scale_queries_and_gradients():
  q, k, v = _qkv(1, lq=25)
  mask = ScaleCausal(LEVELS[14:], LEVELS)

  def loss(backend):
    return lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, mask=mask, backend=backend)))

  with pallas_kernels.override('interpret'):
    got = jax.grad(loss('pallas'), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss('xla'), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('lk,kv_len', [(39, 30), (200, 150)], ids=['few_token_kernel', 'block_sparse_kernel'])
def test_pallas_backend_reads_only_kv_len_keys(lk, kv_len):
  got, want = _both(*_qkv(2, lq=5, lk=lk), kv_len=kv_len)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_pallas_backend_falls_back_to_xla_for_token_masks_and_odd_head_dims():
  q, k, v = _qkv(3, d=12)
  got, want = _both(q, k, v, mask=ScaleCausal(LEVELS, LEVELS))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  q, k, v = _qkv(4)
  mask = TokenMask(jnp.asarray(np.random.default_rng(5).random((2, 1, 39, 39)) < 0.7))
  got, want = _both(q, k, v, mask=mask)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize('lq', [1, 150])
def test_pallas_backend_runs_heads_wider_than_the_kernels_tiles_on_xla(lq):
  """A VAE's one 512-wide head (its mid-block attention) asks a Triton tile for more shared
  memory than a GPU has: no kernel is lowered."""
  q, k, v = _qkv(7, lq=lq, lk=lq, h=1, d=512)
  with pallas_kernels.override('triton'):
    text = jax.jit(lambda q, k, v: attention(q, k, v, backend='pallas')).trace(
        q, k, v).lower(lowering_platforms=('cuda',)).as_text()
  assert 'block_sparse_attention' not in text and 'few_token_attention' not in text
  got, want = _both(q, k, v)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
