"""Random parameters compiled with threefry kernels for a GPU (`var_models.nn.init`)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train import mesh as mesh_lib
from train.state import sharded_init
from var_models.nn.init import compiled_init, threefry_kernels

KERNEL = 'cu_threefry2x32_ffi'


def _gpu_module(fn, key) -> str:
  """StableHLO of jit(fn)(key) lowered for an NVIDIA GPU (cross-platform export: no GPU needed)."""
  return jax.export.export(jax.jit(fn), platforms=['cuda'])(key).mlir_module()


def test_gpu_lowering_draws_with_threefry_kernels_only_inside_the_block():
  draw = lambda k: jax.random.truncated_normal(k, -2.0, 2.0, (64, 32))
  key = jax.random.key(0)
  assert KERNEL not in _gpu_module(draw, key)
  with threefry_kernels():
    inside = _gpu_module(draw, key)
  assert KERNEL in inside
  assert KERNEL not in _gpu_module(draw, key)


def test_threefry_kernels_restores_the_setting_after_an_error():
  before = jax.config.jax_threefry_gpu_kernel_lowering
  with pytest.raises(RuntimeError):
    with threefry_kernels():
      assert jax.config.jax_threefry_gpu_kernel_lowering
      raise RuntimeError('inside')
  assert jax.config.jax_threefry_gpu_kernel_lowering == before


def test_compiled_init_draws_the_parameters_of_a_plain_jit():
  model = nn.Sequential([nn.Dense(48), nn.LayerNorm(), nn.Dense(16, kernel_init=nn.initializers.xavier_uniform())])
  x = jnp.zeros((1, 24))
  init = lambda k: model.init(k, x)['params']
  ours = compiled_init(init, jax.random.key(3))
  plain = jax.jit(init)(jax.random.key(3))
  assert jax.tree.structure(ours) == jax.tree.structure(plain)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.abs(np.asarray(ours['layers_0']['kernel'])).max() > 0


def test_a_train_state_whole_on_every_device_is_drawn_with_threefry_kernels():
  seen = []

  def init_fn(key):
    seen.append(jax.config.jax_threefry_gpu_kernel_lowering)
    return {'w': jax.random.normal(key, (8, 4))}, {}
  mesh = mesh_lib.make_mesh(1, 1, jax.devices()[:1])
  state, _ = sharded_init(init_fn, optax.adam(1e-3), mesh, seed=0)
  assert seen == [False, True]   # the shapes outside the block (abstract_state), the draw inside
  assert not jax.config.jax_threefry_gpu_kernel_lowering
  assert np.abs(np.asarray(state.params['w'])).max() > 0
