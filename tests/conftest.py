"""Shared tiny VAR + VQVAE fixtures (CPU, float32)."""
import os
import shutil
import tempfile

# The suite's time is mostly XLA compiling small programs for the CPU: LLVM's level-0 code
# generation compiles them ~1.5x faster. Set before JAX starts, for the test processes and the
# programs they start, so what the tests compare is compiled alike.
TEST_XLA_FLAGS = '--xla_backend_optimization_level=0'
os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
# For the programs a test starts and compares only with each other: XLA's CPU loop emitters instead of
# its fusion emitters compile them in about a third of the time.
JOB_XLA_FLAGS = f'{TEST_XLA_FLAGS} --xla_cpu_use_fusion_emitters=false'

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from var_models.tokenizers.vqvae import VQVAE, VQVAEConfig
from var_models.var.model import VARConfig, init_params

TINY_PATCH_NUMS = (1, 2, 3, 4)


def pytest_configure(config):
  """The programs the tests start (`python -m train` ...) share one persistent compilation cache for the
  session (made by the controlling process, before any worker starts), never the one in ~/.cache."""
  if not hasattr(config, 'workerinput') and 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
    config.xla_cache = os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='tests_xla_cache_')


def pytest_unconfigure(config):
  if getattr(config, 'xla_cache', None):
    shutil.rmtree(config.xla_cache, ignore_errors=True)


def random_tiny_var_checkpoint(path: str) -> str:
  """A checkpoint at `path` of configs/var.py:tiny with random weights drawn on its parameter shapes
  without compiling its initialisers (`random_stand_in`), for runs that load a VAR rather than train one."""
  from configs import var as var_configs
  from train.tasks import random_stand_in
  from var_models import checkpoint
  from var_models.var import from_config
  var_cfg, vq_cfg = from_config.var_configs(var_configs.get_config('tiny'))
  abstract = jax.eval_shape(lambda k: from_config.init_var_params(var_cfg, vq_cfg, k), jax.random.key(0))
  checkpoint.save_params(path, random_stand_in(abstract, seed=0), {'model': 'random'})
  return path


@pytest.fixture(scope='session')
def tiny_var():
  """(var_cfg, vq_cfg, params) of a 2-block VAR on 4 scales with a 64-code VQVAE."""
  var_cfg = VARConfig(depth=2, width=64, num_heads=2, vocab_size=64, cvae=8, num_classes=10,
                      patch_nums=TINY_PATCH_NUMS)
  vq_cfg = VQVAEConfig(vocab_size=64, z_channels=8, ch=32, ch_mult=(1, 2), num_res_blocks=1,
                       patch_nums=TINY_PATCH_NUMS)
  img = jnp.zeros((1, vq_cfg.image_size, vq_cfg.image_size, 3), jnp.float32)
  params = {'var': init_params(var_cfg, jax.random.key(0)),
            'vqvae': VQVAE(vq_cfg).init(jax.random.key(1), img)['params']}
  # Larger random weights than the official init so logits are far from uniform.
  params['var'] = jax.tree_util.tree_map(
      lambda p: p + 0.05 * jax.random.normal(jax.random.key(p.size), p.shape), params['var'])
  return var_cfg, vq_cfg, params


@pytest.fixture(scope='session')
def sample_tiny(tiny_var):
  """sample(policy=None, var_cfg=None) -> (images, aux): the tiny VAR's sampler (its config, or
  `var_cfg`) with `policy` on labels 1, 7, 3, key 0, cfg 1.5 and no top-k / top-p filter."""
  def sample(policy=None, var_cfg=None):
    from var_models.var.sampler import make_sampler
    config, vq_cfg, params = tiny_var
    return make_sampler(var_cfg or config, vq_cfg, policy)(
        params, jax.random.key(0), np.array([1, 7, 3], np.int32), cfg=1.5, top_k=0, top_p=1.0)
  return sample
