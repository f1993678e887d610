"""E-CAR's train step with `scan_blocks`: the loss and gradients of the unrolled blocks, a program
whose size does not grow with depth, and the config key that turns it on."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import ecar
from configs import ecar as ecar_configs
from ecar.config import ECARConfig
from ecar.from_config import ecar_config

CFG = ECARConfig(image_size=8, num_classes=4, latent_space='pixel', num_stages=2, patch_size=1, ar_depth=3,
                 ar_width=32, ar_heads=2, den_depth=(2, 3), den_width=32, den_heads=2)


def _random_params(cfg, seed=0):
  """Every parameter drawn at random (adaLN-zero would make the DiT blocks the identity)."""
  params = ecar.init_params(cfg, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def _loss(cfg):
  x0 = jax.random.uniform(jax.random.key(3), (2, 8, 8, 3), minval=-1, maxval=1)
  labels = jnp.array([1, 3], jnp.int32)
  gn = ecar.init_gradnorm(cfg)
  return lambda p: ecar.loss_fn(cfg, p, gn, x0, labels, jax.random.key(5))[0]


def test_scanned_train_step_gives_the_unrolled_loss_and_gradients():
  params = _random_params(CFG)
  scanned = dataclasses.replace(CFG, scan_blocks=True)
  (loss, grads), (loss_s, grads_s) = (jax.jit(jax.value_and_grad(_loss(c)))(params) for c in (CFG, scanned))
  np.testing.assert_allclose(loss_s, loss, rtol=1e-5)
  jax.tree_util.tree_map_with_path(
      lambda path, g, got: np.testing.assert_allclose(got, g, rtol=1e-4, atol=1e-6,
                                                      err_msg=jax.tree_util.keystr(path)), grads, grads_s)


def test_the_scanned_train_program_does_not_grow_with_depth():
  def dots(**depths):
    cfg = dataclasses.replace(CFG, scan_blocks=True, **depths)
    text = jax.jit(jax.grad(_loss(cfg))).lower(ecar.init_params(cfg, jax.random.key(0))).as_text()
    return text.count('stablehlo.dot_general')
  assert dots(ar_depth=2, den_depth=(2, 2)) == dots(ar_depth=5, den_depth=(4, 6))


def test_model_scan_blocks_key_reaches_the_model_config():
  c = ecar_configs.get_config('tiny')
  assert not ecar_config(c).scan_blocks
  c.model.scan_blocks = True
  assert ecar_config(c).scan_blocks
