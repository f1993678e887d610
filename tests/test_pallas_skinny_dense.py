"""pallas_kernels.skinny_dense_mgpu: the weights-first skinny GEMM of a chain (Hopper); its lowering
for CUDA runs on the CPU, its numbers against the plain-jnp reference on a Hopper GPU only."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import skinny_dense_mgpu as sk
from pallas_kernels.dispatch import is_hopper


def _inputs(parts, k, n, rp, seed=0):
  kp, kw = jax.random.split(jax.random.key(seed))
  p = jax.random.normal(kp, (parts, k, rp))
  w = (jax.random.normal(kw, (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
  return p, w


def test_parts_of_k_fill_the_sms_with_whole_tiles():
  assert sk.splits_for(1536, 1536, 132) == 4     # 24 column blocks x 4 = 96 CTAs
  assert sk.splits_for(1536, 6144, 132) == 1
  assert sk.splits_for(1024, 1024, 132) == 8
  assert sk.splits_for(64, 9216, 132) == 0       # 144 column blocks


@pytest.mark.parametrize('rp,activation,pdl', [(16, 'silu', True), (32, 'none', False)])
def test_kernel_lowers_for_cuda_on_the_cpu(rp, activation, pdl):
  """Mosaic GPU's lowering (shared memory, layouts, barriers, the dependent-launch ops) runs
  without a GPU."""
  p = jax.ShapeDtypeStruct((4, 1536, rp), jnp.float32)
  w = jax.ShapeDtypeStruct((1536, 1536), jnp.bfloat16)
  fn = lambda p, w: sk.skinny_dense(p, w, activation=activation, num_sms=132, pdl=pdl)
  lowered = jax.jit(fn).trace(p, w).lower(lowering_platforms=('cuda',))
  assert 'mosaic_gpu' in lowered.as_text()


def test_what_it_does_not_take_is_named():
  p, w = _inputs(1, 128, 64, 16)
  with pytest.raises(ValueError, match='Hopper'):
    sk.skinny_dense(p, w, num_sms=0)
  with pytest.raises(ValueError, match=r'\[S, K, 16 or 32\], got float32\[1, 128, 24\]'):
    sk.skinny_dense(jnp.zeros((1, 128, 24)), w, num_sms=132)
  with pytest.raises(ValueError, match=r'bfloat16 weights .* got float32\[128, 64\]'):
    sk.skinny_dense(p, w.astype(jnp.float32), num_sms=132)
  with pytest.raises(ValueError, match=r'3072 rows of K .* 589824 bytes of shared memory for w \[3072, 9216\] in 1'):
    sk.skinny_dense(jnp.zeros((1, 3072, 32)), jnp.zeros((3072, 9216), jnp.bfloat16), num_sms=144)
  with pytest.raises(ValueError, match="activation must be one of \\['none', 'silu'\\], got 'gelu'"):
    sk.skinny_dense(p, w, activation='gelu', num_sms=132)


def test_reference_sums_the_parts_before_the_activation():
  p, w = _inputs(3, 64, 64, 16)
  x = sk.ACTIVATIONS['silu'](p[0] + p[1] + p[2]).astype(jnp.bfloat16).astype(jnp.float32)
  np.testing.assert_allclose(sk.reference(p, w, 'silu'), w.astype(jnp.float32).T @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not is_hopper(), reason='Mosaic GPU wgmma kernels run on Hopper')
@pytest.mark.parametrize('rp', [16, 32])
@pytest.mark.parametrize('pdl', [True, False])
def test_a_chain_of_kernels_matches_the_reference(rp, pdl):
  num_sms = jax.devices()[0].core_count
  p, w1 = _inputs(1, 1536, 1536, rp, seed=rp)
  _, w2 = _inputs(1, 1536, 1536, rp, seed=rp + 1)

  @jax.jit
  def chain(p):
    q = sk.skinny_dense(p, w1, num_sms=num_sms, pdl=pdl)
    return sk.skinny_dense(q, w2, activation='silu', num_sms=num_sms, pdl=pdl)
  got = chain(p).sum(0)
  want = sk.reference(sk.reference(p, w1)[None], w2, 'silu')
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
