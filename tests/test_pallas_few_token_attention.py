"""pallas_kernels.few_token_attention: the kernel in interpret mode against the reference on random
inputs (lengths and head dims padded to powers of two, E-CAR's denoiser shapes), its gradients,
its Triton lowering at E-CAR-L's shapes on the CPU (one kernel for a program's calls of one shape),
and the `pallas` and `cudnn` attention backends' use of it."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import few_token_attention
from pallas_kernels.reference import masked_attention
from var_models.nn import attention as attention_lib
from var_models.nn.attention import ScaleCausal, TokenMask, attention


def _qkv(seed, lq, lk, h=3, d=72, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal((2, n, h, d)), dtype) for n in (lq, lk, lk))


def _want(q, k, v, scale):
  return masked_attention(q, k, v, np.ones((1, q.shape[1], k.shape[1]), bool), scale)[0]


@pytest.mark.parametrize('lq,lk,d', [(4, 4, 72), (16, 16, 72), (64, 64, 72), (37, 37, 16), (5, 30, 24)])
def test_kernel_matches_the_reference(lq, lk, d):
  q, k, v = _qkv(lq + d, lq, lk, d=d)
  got = few_token_attention(q, k, v, scale=0.3, impl='interpret')
  assert got.shape == q.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(_want(q, k, v, 0.3)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('lq,lk,d', [(320, 320, 80), (300, 200, 80), (129, 130, 32), (64, 320, 80), (71, 320, 80)])
def test_calls_over_more_than_one_block_loop_over_key_blocks_with_the_references_values(lq, lk, d):
  """Past ONE_BLOCK tokens a program holds a block of queries and loops over blocks of keys (MAR's
  320 tokens of 80-wide heads); partial last blocks on both axes."""
  q, k, v = _qkv(lq * lk, lq, lk, h=2, d=d)
  got = few_token_attention(q, k, v, scale=0.3, impl='interpret')
  np.testing.assert_allclose(np.asarray(got), np.asarray(_want(q, k, v, 0.3)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('lq,lk', [(16, 16), (320, 320), (40, 200)])
def test_a_key_mask_hides_each_samples_keys_and_a_query_that_sees_none_gives_zeros(lq, lk):
  """MAR's encoder: each sample attends to its own known tokens; sample 1 here sees no key."""
  q, k, v = _qkv(lq + lk, lq, lk, h=2, d=80)
  seen = np.random.default_rng(lk).random((2, lk)) < 0.6
  seen[1] = False
  got = few_token_attention(q, k, v, scale=0.3, key_mask=seen, impl='interpret')
  want = jnp.concatenate([masked_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                           np.broadcast_to(seen[i], (1, lq, lk)), 0.3)[0] for i in range(2)])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  assert not np.asarray(got[1]).any()
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
  g = jax.grad(loss(lambda *a: few_token_attention(*a, scale=0.3, key_mask=seen, impl='interpret')))(q, k, v)
  w = jax.grad(loss(lambda *a: few_token_attention(*a, scale=0.3, key_mask=seen, impl='reference')))(q, k, v)
  np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_lowers_to_triton_at_mar_h_shapes_without_a_copy():
  """MAR-H's decoder (320 tokens, 16 heads of 80, guidance's two samples) and its encoder under
  a key mask: one kernel reading [B, L, H, D] in place."""
  x = jax.ShapeDtypeStruct((2, 320, 16, 80), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((2, 320), jnp.bool_)
  f = lambda q, k, v, m: few_token_attention(q, k, v, key_mask=m, impl='triton')
  text = jax.jit(f).trace(x, x, x, mask).lower(lowering_platforms=('cuda',)).as_text()
  assert 'few_token_attention' in text
  assert 'stablehlo.transpose' not in text and 'stablehlo.pad' not in text and 'stablehlo.slice' not in text


@pytest.mark.parametrize('lq,buffer,kv_len', [(1, 84, 1), (9, 84, 20), (64, 84, 84), (25, 200, 91)])
def test_kernel_reads_only_the_first_kv_len_keys_of_a_buffer(lq, buffer, kv_len):
  """A KV cache's buffer read in place: its spare rows (NaN here) are never read."""
  q, k, v = _qkv(lq + kv_len, lq, buffer, d=32)
  spare = np.arange(buffer)[None, :, None, None] >= kv_len
  k, v = (jnp.where(spare, jnp.nan, x) for x in (k, v))
  got = few_token_attention(q, k, v, scale=0.3, kv_len=kv_len, impl='interpret')
  want = _want(q, k[:, :kv_len], v[:, :kv_len], 0.3)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_kernel_in_bfloat16_is_within_bfloat16_rounding():
  q, k, v = _qkv(1, 64, 64, h=16, dtype=jnp.bfloat16)
  got = np.asarray(few_token_attention(q, k, v, impl='interpret'), np.float32)
  want = np.asarray(_want(*(x.astype(jnp.float32) for x in (q, k, v)), 72 ** -0.5))
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize('kv_len', [None, 11])
def test_gradients_equal_the_references(kv_len):
  q, k, v = _qkv(2, 16, 16)
  n = kv_len or 16
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
  got = jax.grad(loss(lambda *a: few_token_attention(*a, kv_len=kv_len, impl='interpret')),
                 argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(lambda q, k, v: _want(q, k[:, :n], v[:, :n], 72 ** -0.5)), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('tokens', [4, 16, 64])
def test_lowers_to_triton_at_e_car_l_shapes(tokens):
  """Triton IR on the CPU for E-CAR-L's denoiser attention at batch 1 with guidance (not compiled
  by Triton here): every block a power of two."""
  x = jax.ShapeDtypeStruct((2, tokens, 16, 72), jnp.bfloat16)
  f = lambda q, k, v: few_token_attention(q, k, v, impl='triton')
  text = jax.jit(f).trace(x, x, x).lower(lowering_platforms=('cuda',)).as_text()
  assert 'few_token_attention' in text
  # [B, L, H, D] read and written in place: no copy around the kernel.
  assert 'stablehlo.transpose' not in text and 'stablehlo.pad' not in text and 'stablehlo.slice' not in text


def test_a_programs_calls_of_one_shape_lower_the_kernel_once():
  """A model's blocks call the kernel at one shape: one kernel in the program however many calls
  (`dispatch.per_shape`), another for another shape."""
  x = jax.ShapeDtypeStruct((2, 16, 4, 32), jnp.bfloat16)

  def blocks(q, k, v, kv_lens):
    for kv_len in kv_lens:
      q = few_token_attention(q, k, v, kv_len=kv_len, impl='triton')
    return q
  kernels = lambda *kv_lens: jax.jit(functools.partial(blocks, kv_lens=kv_lens)).trace(x, x, x).lower(
      lowering_platforms=('cuda',)).as_text().count('__gpu$xla.gpu.triton')
  assert kernels(None, None, None, None) == 1
  assert kernels(None, 8, None, 8) == 2


def test_unsupported_inputs_name_the_misfit():
  q, k, v = _qkv(3, 513, 513, h=1, d=16)
  with pytest.raises(ValueError, match='at most 512 queries and keys, got Lq=513'):
    few_token_attention(q, k, v)
  q, k, v = _qkv(3, 8, 600, h=1, d=16)
  with pytest.raises(ValueError, match='got Lq=8, 513 keys'):
    few_token_attention(q, k, v, kv_len=513)
  with pytest.raises(ValueError, match=r'kv_len must be in \(0, Lk = 600\], got 0'):
    few_token_attention(q, k, v, kv_len=0)
  with pytest.raises(ValueError, match=r'key_mask \[B, Lk\] = \(2, 600\) expected, got \(2, 8\)'):
    few_token_attention(q, k, v, key_mask=np.ones((2, 8), bool))
  q, k, v = _qkv(3, 128, 128, h=1, d=128)
  with pytest.raises(ValueError, match='holds 192 KiB of padded q, k, v blocks'):
    few_token_attention(q, k, v)
  q, k, v = _qkv(3, 1, 1, h=1, d=512)
  with pytest.raises(ValueError, match='head dim at most 128, got 512'):
    few_token_attention(q, k, v)
  q, k, v = _qkv(3, 8, 8, d=16, dtype=jnp.int32)
  with pytest.raises(ValueError, match='one dtype among'):
    few_token_attention(q, k, v)
  q, k, v = _qkv(3, 8, 8, d=16)
  with pytest.raises(ValueError, match="impl='mosaic'"):
    few_token_attention(q, k, v, impl='mosaic')


def test_pallas_backend_runs_it_unmasked_or_under_a_key_mask():
  q, k, v = _qkv(4, 64, 64, h=2, d=72, dtype=jnp.bfloat16)
  text = lambda **kw: jax.jit(lambda q, k, v: attention(q, k, v, backend='pallas', **kw)).trace(
      q, k, v).lower(lowering_platforms=('cuda',)).as_text()
  with pallas_kernels.override('triton'):
    assert 'few_token_attention' in text()
    levels = np.arange(64) // 16
    assert 'few_token_attention' not in text(mask=ScaleCausal(levels, levels))
    assert 'few_token_attention' in text(kv_len=40)
    assert 'few_token_attention' in text(mask=TokenMask(np.ones((2, 1, 1, 64), bool)))
    assert 'few_token_attention' not in text(mask=TokenMask(np.ones((2, 1, 64, 64), bool)))
  with pallas_kernels.override('interpret'):
    got = attention(q, k, v, backend='pallas')
  want = attention(q, k, v, backend='xla')
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


def test_cudnn_backend_runs_the_kernel_only_where_the_call_is_not_differentiated():
  """The `cudnn` backend's wrapper, around the xla backend (cuDNN needs a GPU): a sampler's
  unmasked or key-masked call of one block, or of MAR's 320 tokens without a KV cache at batch 1,
  lowers to the kernel (at batch 16, cuDNN's call); a differentiated one, a scale-causal one or
  one past one block over a KV cache (VAR's later scales) keeps the wrapped backend."""
  routed = attention_lib._few_tokens_on_the_kernel(attention_lib._BACKENDS['xla'])
  dense = attention_lib._BACKENDS['xla']
  q, k, v = _qkv(5, 16, 16, h=2, dtype=jnp.bfloat16)
  call = lambda backend: lambda q, k, v: backend(q, k, v, None, 0.3, None)
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32)))
  text = lambda f, *a: jax.jit(f).trace(*(a or (q, k, v))).lower(lowering_platforms=('cuda',)).as_text()
  keys = TokenMask(np.arange(16)[None, None, None, :] < np.array([9, 16])[:, None, None, None])
  with pallas_kernels.override('triton'):
    assert 'few_token_attention' in text(call(routed))
    assert 'few_token_attention' not in text(jax.grad(loss(call(routed)), argnums=(0, 1, 2)))
    assert 'few_token_attention' in text(lambda q, k, v: routed(q, k, v, None, 0.3, 8))
    levels = np.arange(16) // 4
    assert 'few_token_attention' not in text(lambda q, k, v: routed(q, k, v, ScaleCausal(levels, levels), 0.3, None))
    assert 'few_token_attention' in text(lambda q, k, v: routed(q, k, v, keys, 0.3, None))
    long = jax.ShapeDtypeStruct((2, 320, 2, 80), jnp.bfloat16)   # MAR's 320 tokens at batch 1
    assert 'few_token_attention' in text(lambda q, k, v: routed(q, k, v, None, 0.3, None), long, long, long)
    rows = attention_lib.FEW_TOKEN_MAX_QUERIES // 320 + 1   # past it (MAR at batch 16): cuDNN's call
    many = jax.ShapeDtypeStruct((rows, 320, 2, 80), jnp.bfloat16)
    assert 'few_token_attention' not in text(lambda q, k, v: routed(q, k, v, None, 0.3, None), many, many, many)
    assert 'few_token_attention' in text(lambda q, k, v: routed(q, k, v, None, 0.3, None),
                                         *[jax.ShapeDtypeStruct((rows, 64, 2, 64), jnp.bfloat16)] * 3)
    few, cache = jax.ShapeDtypeStruct((2, 64, 2, 64), jnp.bfloat16), jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)
    assert 'few_token_attention' not in text(lambda q, k, v: routed(q, k, v, None, 0.3, 155), few, cache, cache)
  masked = jax.jit(lambda q, k, v, m: routed(q, k, v, TokenMask(m), 0.3, None))
  masked_loss = lambda backend: lambda q, k, v, m: jnp.sum(jnp.sin(
      backend(q, k, v, TokenMask(m), 0.3, None).astype(jnp.float32)))
  with pallas_kernels.override('interpret'):
    np.testing.assert_array_equal(np.asarray(call(routed)(q, k, v), np.float32),
                                  np.asarray(few_token_attention(q, k, v, scale=0.3), np.float32))
    np.testing.assert_array_equal(
        np.asarray(masked(q, k, v, keys.mask), np.float32),
        np.asarray(few_token_attention(q, k, v, scale=0.3, key_mask=keys.mask[:, 0, 0]), np.float32))
    got = jax.grad(loss(call(routed)), argnums=(0, 1, 2))(q, k, v)
    got_masked = jax.jit(jax.grad(masked_loss(routed), argnums=(0, 1, 2)))(q, k, v, keys.mask)
  want = jax.grad(loss(call(dense)), argnums=(0, 1, 2))(q, k, v)
  want_masked = jax.grad(masked_loss(dense), argnums=(0, 1, 2))(q, k, v, keys.mask)
  for g, w in zip(got + got_masked, want + want_masked):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_packed_qkv_is_read_in_place_and_equals_its_slices():
  """A fused projection's qkv [B, L, 3, H, D]: the kernel reads its three parts in place (no slice
  in the lowered program), with the slices' values and gradients."""
  qkv = jnp.stack(_qkv(6, 16, 16, h=2, d=24), axis=2)
  parts = lambda x: (x[:, :, 0], x[:, :, 1], x[:, :, 2])
  got = few_token_attention(qkv, scale=0.3, impl='interpret')
  np.testing.assert_allclose(np.asarray(got), np.asarray(_want(*parts(qkv), 0.3)), rtol=2e-5, atol=2e-5)
  loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)))
  g = jax.grad(loss(lambda x: few_token_attention(x, scale=0.3, impl='interpret')))(qkv)
  w = jax.grad(loss(lambda x: _want(*parts(x), 0.3)))(qkv)
  np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
  shape = jax.ShapeDtypeStruct((2, 64, 3, 16, 72), jnp.bfloat16)
  text = jax.jit(lambda x: few_token_attention(x, impl='triton')).trace(shape).lower(
      lowering_platforms=('cuda',)).as_text()
  assert 'few_token_attention' in text and 'stablehlo.slice' not in text
  with pytest.raises(ValueError, match=r'a packed qkv \[B, L, 3, H, D\] expected'):
    few_token_attention(qkv[:, :, :2])


@pytest.mark.parametrize('backend', ['cudnn', 'pallas'])
def test_backends_read_a_packed_qkv_in_place_where_they_run_the_kernel(backend):
  """`attention(qkv)` (self-attention of a packed qkv): the few-token backends lower to the kernel
  with no slice of it; the xla backend computes the slices' attention; differentiated, the `cudnn`
  backend's wrapper keeps the wrapped backend (here xla's: cuDNN's backward needs a GPU)."""
  qkv = jnp.stack(_qkv(7, 16, 16, h=2, d=72, dtype=jnp.bfloat16), axis=2)
  text = lambda f: jax.jit(f).trace(qkv).lower(lowering_platforms=('cuda',)).as_text()
  run = lambda x: attention(x, backend=backend)
  routed = attention_lib._few_tokens_on_the_kernel(attention_lib._BACKENDS['xla'])
  packed = lambda x: routed(*(x[:, :, i] for i in range(3)), None, 0.3, None, packed=x)
  with pallas_kernels.override('triton'):
    lowered = text(run)
    assert 'few_token_attention' in lowered and 'stablehlo.slice' not in lowered
    assert 'few_token_attention' not in text(jax.grad(lambda x: jnp.sum(packed(x).astype(jnp.float32))))
  with pallas_kernels.override('interpret'):
    got = np.asarray(run(qkv), np.float32)
  want = np.asarray(attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], backend='xla'), np.float32)
  np.testing.assert_allclose(got, want, atol=2e-2)
  np.testing.assert_array_equal(np.asarray(attention(qkv, backend='xla')), np.asarray(
      attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], backend='xla')))
