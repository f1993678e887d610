"""Block-sparse flash attention (Pallas, interpret mode) against its float64 reference.

Interpret mode fills every output with NaN before the kernel runs (checked
below), so an element the kernel fails to write fails the comparison.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import (block_sparse_attention, dense_layout, layout_from_mask,
                            masked_attention, scale_causal_layout)
from pallas_kernels.dispatch import is_hopper

BLOCK = 16
SUB = 8   # backward sub-blocks, so the sub-block walk is exercised


def _qkv(seed, b=2, lq=37, lk=45, h=2, d=16, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal((b, n, h, d)), dtype) for n in (lq, lk, lk))


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.isfinite(got).all(), 'kernel left unwritten (NaN) or non-finite elements'
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _ref(q, k, v, mask, scale=None):
  """float64 (out, lse) of the reference on the same (possibly bf16-rounded) inputs."""
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v)]
    out, lse = masked_attention(*args, jnp.asarray(mask), scale)
    return np.asarray(out), np.asarray(lse)


def _run(q, k, v, layout, **kw):
  return block_sparse_attention(q, k, v, layout, return_lse=True, impl='interpret',
                                bwd_block_q=SUB, bwd_block_k=SUB, **kw)


def _random_mask(seed, h, lq, lk, p=0.4):
  rng = np.random.default_rng(seed)
  mask = rng.random((h, lq, lk)) < p
  mask[:, :, BLOCK:2 * BLOCK] = True  # a column of full tiles beside partial ones
  return mask


def _check_forward(q, k, v, mask, layout, tol=1e-5, **kw):
  out, lse = _run(q, k, v, layout, **kw)
  ref_out, ref_lse = _ref(q, k, v, mask, kw.get('scale'))
  assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == ref_lse.shape
  assert _rel(out, ref_out) < tol
  np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(ref_lse))
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=tol, atol=tol)
  return out


def test_interpret_mode_poisons_outputs_before_the_kernel_runs():
  # The precondition of every "unwritten elements fail" check in this file.
  out = pl.pallas_call(lambda o_ref: None, out_shape=jax.ShapeDtypeStruct((4, 8), jnp.float32),
                       interpret=True)()
  assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize('per_head', [False, True])
def test_token_mask_layout_with_tails_matches_reference(per_head):
  q, k, v = _qkv(0)  # 37 queries, 45 keys: neither a multiple of 16
  mask = _random_mask(1, 2 if per_head else 1, 37, 45)
  layout = layout_from_mask(mask, BLOCK, BLOCK)
  assert layout.heads == mask.shape[0]
  _check_forward(q, k, v, mask, layout)


def test_per_head_layouts_differ_per_head():
  q, k, v = _qkv(2)
  mask = _random_mask(3, 2, 37, 45)
  mask[1, :, :BLOCK] = False
  out = _check_forward(q, k, v, mask, layout_from_mask(mask, BLOCK, BLOCK))
  # Head 0 and head 1 under head 0's mask would differ: the head index is honoured.
  swapped, _ = _ref(q, k, v, mask[[0, 0]])
  assert np.abs(np.asarray(out)[:, :, 1] - swapped[:, :, 1]).max() > 1e-2


def test_empty_query_rows_give_zero_output_and_minus_inf_lse():
  q, k, v = _qkv(4)
  mask = _random_mask(5, 1, 37, 45)
  mask[0, :BLOCK] = False          # a whole empty query block (no tiles at all)
  mask[0, 20] = False              # one empty row inside a block with partial tiles
  layout = layout_from_mask(mask, BLOCK, BLOCK)
  assert layout.kv_count[0, 0] == 0
  out, lse = _run(q, k, v, layout)
  _check_forward(q, k, v, mask, layout)
  assert (np.asarray(out)[:, :BLOCK] == 0).all() and (np.asarray(out)[:, 20] == 0).all()
  assert np.isneginf(np.asarray(lse)[:, :, :BLOCK]).all()


def test_all_full_layout_equals_dense_attention():
  q, k, v = _qkv(6, lq=33, lk=50)
  layout = dense_layout(33, 50, BLOCK, BLOCK)
  # Every tile is full except the key tail (50 = 3 * 16 + 2), which is partial.
  assert (layout.kv_full == 3).all() and (layout.kv_count == 4).all()
  _check_forward(q, k, v, np.ones((1, 33, 50), bool), layout)


def test_all_empty_layout_writes_zeros():
  q, k, v = _qkv(7)
  layout = layout_from_mask(np.zeros((1, 37, 45), bool), BLOCK, BLOCK)
  assert (layout.kv_count == 0).all() and (layout.q_count == 0).all()
  out, lse = _run(q, k, v, layout)
  assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
  dq, dk, dv = jax.grad(lambda *a: _run(*a, layout)[0].sum(), argnums=(0, 1, 2))(q, k, v)
  for g in (dq, dk, dv):
    assert (np.asarray(g) == 0).all()


def test_scale_causal_layout_with_custom_scale():
  patch_nums = (1, 2, 3, 5)        # L = 39
  q, k, v = _qkv(8, lq=39, lk=39)
  levels = np.repeat(np.arange(4), [1, 4, 9, 25])
  mask = (levels[:, None] >= levels[None])[None]
  _check_forward(q, k, v, mask, scale_causal_layout(patch_nums, BLOCK, BLOCK), scale=0.7)


@pytest.mark.parametrize('d', [64, 128])
def test_bfloat16_head_dims_match_reference_within_bf16_tolerance(d):
  q, k, v = _qkv(9, b=1, lq=20, lk=40, h=1, d=d, dtype=jnp.bfloat16)
  mask = _random_mask(10, 1, 20, 40, p=0.6)
  _check_forward(q, k, v, mask, layout_from_mask(mask, BLOCK, BLOCK), tol=1e-2)


def _loss(attn):
  def loss(q, k, v):
    out, lse = attn(q, k, v)
    # Cotangents on both outputs; lse only where finite (empty rows have -inf).
    return jnp.sum(jnp.sin(out.astype(jnp.float32))) + 0.3 * jnp.sum(
        jnp.where(jnp.isfinite(lse), lse, 0.0))
  return loss


def _ref_grads(q, k, v, mask):
  """float64 gradients of `_loss` through the reference on the same inputs."""
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v)]
    attn = lambda *a: masked_attention(*a, jnp.asarray(mask), 1 / np.sqrt(q.shape[-1]))
    return jax.grad(_loss(attn), argnums=(0, 1, 2))(*args)


@pytest.mark.parametrize('per_head', [False, True])
def test_gradients_match_reference_gradients(per_head):
  q, k, v = _qkv(11)
  mask = _random_mask(12, 2 if per_head else 1, 37, 45)
  mask[0, 5] = False               # an empty query row
  layout = layout_from_mask(mask, BLOCK, BLOCK)
  got = jax.grad(_loss(lambda *a: _run(*a, layout)), argnums=(0, 1, 2))(q, k, v)
  ref = _ref_grads(q, k, v, mask)
  for name, g, r in zip('qkv', got, ref):
    assert _rel(g, r) < 1e-5, name


def test_reference_impl_and_jit_agree_with_interpret():
  q, k, v = _qkv(13)
  mask = _random_mask(14, 1, 37, 45)
  layout = layout_from_mask(mask, BLOCK, BLOCK)
  fast = jax.jit(lambda *a: block_sparse_attention(*a, layout, impl='interpret'))(q, k, v)
  slow = block_sparse_attention(q, k, v, layout, impl='reference')
  np.testing.assert_allclose(np.asarray(fast), np.asarray(slow), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('change, match', [
    (dict(d=12), 'power of two'),
    (dict(d=256), r'power of two in \[16, 128\], got 256'),
    (dict(lq=36), 'layout is for'),
    (dict(h=3), 'heads'),
])
def test_bad_inputs_raise_clear_errors(change, match):
  layout = layout_from_mask(np.ones((2, 37, 45), bool), BLOCK, BLOCK)
  q, k, v = _qkv(15, **change)
  with pytest.raises(ValueError, match=match):
    block_sparse_attention(q, k, v, layout, impl='interpret')


def test_backward_sub_block_must_divide_the_tile():
  q, k, v = _qkv(16)
  layout = dense_layout(37, 45, BLOCK, BLOCK)
  with pytest.raises(ValueError, match='bwd_block_q'):
    block_sparse_attention(q, k, v, layout, impl='interpret', bwd_block_q=6)


def test_keys_past_the_layout_length_are_ignored_and_get_no_gradient():
  """A KV cache with spare rows: k, v longer than layout.lk (up to its last key block)."""
  q, k, v = _qkv(17, lk=48)
  mask = _random_mask(18, 1, 37, 45)
  layout = layout_from_mask(mask, BLOCK, BLOCK)
  out, lse = _run(q, k, v, layout)
  ref_out, ref_lse = _ref(q, k[:, :45], v[:, :45], mask)
  assert _rel(out, ref_out) < 1e-5
  grads = jax.grad(_loss(lambda *a: _run(*a, layout)), argnums=(1, 2))(q, k, v)
  for g in grads:
    np.testing.assert_array_equal(np.asarray(g[:, 45:]), 0.0)
  with pytest.raises(ValueError, match=r'k length in \[45, 48\]'):
    block_sparse_attention(*_qkv(19, lk=49), layout, impl='interpret')


def test_mosaic_impl_names_why_it_cannot_run():
  q, k, v = _qkv(20)  # float32, head dim 16: not for the Mosaic GPU kernels
  layout = dense_layout(37, 45, BLOCK, BLOCK)
  with pytest.raises(ValueError, match="impl='mosaic'.*bfloat16 or float16"):
    block_sparse_attention(q, k, v, layout, impl='mosaic')


@pytest.mark.skipif(not is_hopper(), reason='the Mosaic GPU kernels run on Hopper GPUs only')
@pytest.mark.parametrize('lq, lk, block_k, d', [(256, 336, 64, 64), (384, 520, 128, 128),
                                               (389, 517, 128, 128)])  # padded to 8s inside
def test_mosaic_forward_matches_reference_on_hopper(lq, lk, block_k, d):
  q, k, v = _qkv(21, b=2, lq=lq, lk=lk, h=3, d=d, dtype=jnp.bfloat16)
  mask = np.random.default_rng(22).random((3, lq, lk - 3)) < 0.4
  mask[:, :, :block_k] = True      # full tiles beside partial ones
  mask[:, 40:60] = False           # empty query rows
  layout = layout_from_mask(mask, 128, block_k)
  out, lse = block_sparse_attention(q, k, v, layout, return_lse=True, impl='mosaic')
  ref_out, ref_lse = _ref(q, k[:, :lk - 3], v[:, :lk - 3], mask)
  assert _rel(out, ref_out) < 1e-2
  np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(ref_lse))
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not is_hopper(), reason='the Mosaic GPU kernels run on Hopper GPUs only')
@pytest.mark.parametrize('lq, lk, block_k, d, per_head', [
    (256, 336, 64, 64, True), (392, 520, 128, 128, False), (392, 520, 128, 128, True),
    (389, 517, 128, 128, False)])
def test_mosaic_gradients_match_reference_on_hopper(lq, lk, block_k, d, per_head):
  h = 3
  q, k, v = _qkv(23, b=2, lq=lq, lk=lk, h=h, d=d, dtype=jnp.bfloat16)
  mask = np.random.default_rng(24).random((h if per_head else 1, lq, lk - 3)) < 0.4
  mask[:, :, :block_k] = True                  # full tiles beside partial ones
  mask[:, :, 2 * block_k:3 * block_k] = False  # a key block no query visits
  mask[:, 40:60] = False                       # empty query rows
  layout = layout_from_mask(mask, 128, block_k)
  attn = lambda *a: block_sparse_attention(*a, layout, return_lse=True, impl='mosaic')
  dq, dk, dv = jax.grad(_loss(attn), argnums=(0, 1, 2))(q, k, v)
  ref = _ref_grads(q, k[:, :lk - 3], v[:, :lk - 3], mask)
  for name, g, r in zip('qkv', (dq, dk[:, :lk - 3], dv[:, :lk - 3]), ref):
    assert _rel(g, r) < 1e-2, name
  for g in (dk, dv):   # the key rows past the layout's lk
    np.testing.assert_array_equal(np.asarray(g[:, lk - 3:], np.float32), 0.0)
