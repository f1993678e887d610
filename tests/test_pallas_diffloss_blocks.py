"""MAR's DiffLoss res blocks as one Mosaic GPU kernel: the reference is the flax blocks; the kernel
lowers for CUDA on the CPU (its Mosaic GPU lowering runs here) and, on a Hopper GPU, matches the
reference on random inputs, the same on every run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels.diffloss_blocks_mgpu import diffloss_blocks, device_sms, unsupported
from pallas_kernels.dispatch import is_hopper
from var_models.mar.diffloss import ResBlock


def test_reference_equals_the_flax_res_blocks():
  x, mods, w1, b1, w2, b2, g, be = reference.diffloss_blocks_inputs(5, 32, 3, weights=jnp.float32)
  h = x
  for i in range(3):
    params = {'in_ln': {'scale': g[i], 'bias': be[i]}, 'mlp_0': {'kernel': w1[i], 'bias': b1[i]},
              'mlp_2': {'kernel': w2[i], 'bias': b2[i]}}
    h = ResBlock(32).apply({'params': params}, h, None, mods[:, 96 * i:96 * (i + 1)])
  got = reference.diffloss_blocks(x, mods, w1, b1, w2, b2, g, be)
  np.testing.assert_allclose(np.asarray(got), np.asarray(h), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named_before_compiling():
  x, mods, w1, b1, w2, b2, g, be = reference.diffloss_blocks_inputs(8, 128, 2)
  assert 'Hopper' in unsupported(x, w1, 0)
  assert 'at most 16 rows' in unsupported(jnp.zeros((20, 128)), w1, 132)
  assert 'multiple of 64' in unsupported(jnp.zeros((8, 96)), jnp.zeros((2, 96, 96), jnp.bfloat16), 132)
  assert 'bfloat16 weights, got float32' in unsupported(x, w1.astype(jnp.float32), 132)
  assert 'more than 1 SMs' in unsupported(x, w1, 1)
  with pytest.raises(ValueError, match=r'b1 \(3, 128\) \(want \(2, 128\)\)'):
    diffloss_blocks(x, mods, w1, jnp.zeros((3, 128)), w2, b2, g, be, num_sms=132)
  with pytest.raises(ValueError, match='blocks_per_call 3 does not divide the 2 blocks'):
    diffloss_blocks(x, mods, w1, b1, w2, b2, g, be, num_sms=132, blocks_per_call=3)
  with pytest.raises(ValueError, match='mods'):
    diffloss_blocks(x, mods[:, :100], w1, b1, w2, b2, g, be, num_sms=132)
  if not device_sms():
    with pytest.raises(ValueError, match='Hopper'):
      diffloss_blocks(x, mods, w1, b1, w2, b2, g, be)


@pytest.mark.parametrize('rows, unroll, per_call', [(5, False, None), (16, True, 3)])
def test_kernel_lowers_for_cuda_at_mar_h_width(rows, unroll, per_call):
  """Mosaic GPU's lowering (layouts, shared memory, barriers) runs without a GPU: at MAR-H's width
  on 132 SMs (an H100 / H200), two blocks in a loop, or 12 as four calls of three unrolled."""
  depth = 2 if per_call is None else 12
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in reference.diffloss_blocks_inputs(rows, 1536, depth)]
  lowered = diffloss_blocks.trace(*args, num_sms=132, unroll=unroll, blocks_per_call=per_call).lower(
      lowering_platforms=('cuda',))
  assert lowered.as_text().count('mosaic_gpu') >= (1 if per_call is None else depth // per_call)


@pytest.mark.skipif(not is_hopper(), reason='the Mosaic GPU kernel runs on Hopper GPUs only')
@pytest.mark.parametrize('rows, per_call', [(2, 3), (8, 3), (16, 3), (8, 1)])
def test_kernel_matches_the_reference_on_random_inputs_every_run(rows, per_call):
  args = reference.diffloss_blocks_inputs(rows, 1536, 3, seed=rows)
  want = np.asarray(reference.diffloss_blocks(*args))
  run = lambda: np.asarray(diffloss_blocks(*args, unroll=True, blocks_per_call=per_call))
  got = run()
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert rel < 5e-3, rel   # the GEMMs' operands in bf16 (XLA's bf16 blocks: ~7e-3)
  np.testing.assert_array_equal(run(), got)
