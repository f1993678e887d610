"""VAR's sampler with its blocks scanned (`scan_blocks=True`): the unrolled sampler's images with
every policy, one block per run of alike blocks in the program (accelerated ones too), the stacked
caches written in place."""
import dataclasses
import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from accel import FastVAR, LazyVAR, SparVAR
from accel.fastvar import FastVARHooks
from var_models.nn import scan as scan_module
from var_models.nn.attention import LayerKVCaches
from var_models.nn.blocks import BlockHooks
from var_models.var.model import init_params
from var_models.var.sampler import make_sampler

LABELS = np.array([1, 7, 3], np.int32)


@pytest.fixture(scope='module')
def deep_var(tiny_var):
  """The tiny VAR with 5 blocks: runs of several blocks around the hooked ones."""
  var_cfg, vq_cfg, params = tiny_var
  var_cfg = dataclasses.replace(var_cfg, depth=5)
  var = init_params(var_cfg, jax.random.key(0))
  var = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(p.size), p.shape), var)
  return var_cfg, vq_cfg, {'var': var, 'vqvae': params['vqvae']}


def _both(var_cfg, vq_cfg, params, policy=None):
  out = []
  for scan in (False, True):
    sample = make_sampler(var_cfg, vq_cfg, policy, scan_blocks=scan, return_fhats=True)
    out.append(sample(sample.prepare(params), jax.random.key(4), LABELS, cfg=1.5, top_k=0, top_p=1.0))
  return out


def _qkv_dots(lowered, width: int) -> list[str]:
  """The lowered program's qkv GEMMs (a result of 3 x width channels)."""
  return [ln for ln in lowered.as_text().splitlines()
          if 'stablehlo.dot_general' in ln and ln.endswith(f'x{3 * width}xf32>')]


def _assert_same(unrolled, scanned):
  (images_u, aux_u), (images_s, aux_s) = unrolled, scanned
  for a, b in zip(aux_u['indices'], aux_s['indices'], strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(aux_u['f_hats'], aux_s['f_hats'], strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(images_u, images_s, rtol=1e-5, atol=1e-5)


def test_scanned_baseline_samples_the_unrolled_images(deep_var):
  _assert_same(*_both(*deep_var))


def test_scanned_fc1_at_the_fused_kernels_row_counts_samples_the_unrolled_images(deep_var, monkeypatch):
  """Every fc1 through `pallas_kernels.dense_gelu` (its reference on the CPU) on the layer's slice."""
  monkeypatch.setattr(importlib.import_module('pallas_kernels.dense_gelu'), 'AUTO_MIN_ROWS', 0)
  _assert_same(*_both(*deep_var))


@pytest.mark.parametrize('policy', [
    FastVAR(ratios=((3, 0.5), (4, 0.5)), cache_at=2, blocks=(1, 2, 3)),
    LazyVAR(start=2, retention=(0.5, 0.25)),
    SparVAR(decision=3, sparse=(4,), group=16, sink_scales=1, topk=0.3, cs4a_layers=0.4, windows=(1, 1, 3),
            block=16),
], ids=['fastvar', 'lazyvar', 'sparvar'])
def test_each_accelerator_samples_the_same_images_scanned(deep_var, policy):
  with pk.override('interpret'):
    _assert_same(*_both(*deep_var, policy))


def test_the_scanned_program_holds_one_block_per_run(deep_var):
  """5 blocks, 4 scales: the unrolled program has a qkv GEMM per block and scale, the scanned one
  a single block in each scale's loop."""
  var_cfg, vq_cfg, params = deep_var
  width = var_cfg.width

  def qkv_dots(scan):
    lowered = make_sampler(var_cfg, vq_cfg, scan_blocks=scan).lower(params, jax.random.key(0), LABELS)
    return len(_qkv_dots(lowered, width)), lowered.as_text().count('stablehlo.while')
  dots_u, loops_u = qkv_dots(False)
  dots_s, loops_s = qkv_dots(True)
  assert loops_s - loops_u == var_cfg.schedule.num_scales
  assert dots_u == var_cfg.depth * var_cfg.schedule.num_scales and dots_s == var_cfg.schedule.num_scales


def test_prepared_parameters_are_stacked_once_not_on_every_call(deep_var):
  """`prepare` stacks the blocks where the parameters are loaded: the program then stacks none of
  them (the qkv kernels' stack [depth, C, 3C]), and samples the images of the tree as it was."""
  var_cfg, vq_cfg, params = deep_var
  sample = make_sampler(var_cfg, vq_cfg, scan_blocks=True)
  prepared = sample.prepare(params)
  assert 'blocks_0' not in prepared['var'] and prepared['var']['blocks_stacked']['attn']['mat_qkv']['kernel'].shape == (
      var_cfg.depth, var_cfg.width, 3 * var_cfg.width)
  stack = f'{var_cfg.depth}x{var_cfg.width}x{3 * var_cfg.width}xf32>'

  def stacks(p):
    text = sample.lower(p, jax.random.key(0), LABELS).as_text()
    return sum(1 for ln in text.splitlines() if 'stablehlo.concatenate' in ln and ln.endswith(stack))
  assert stacks(params) > 0 and stacks(prepared) == 0   # (one per scan before XLA merges them)
  images, _ = sample(params, jax.random.key(4), LABELS)
  np.testing.assert_array_equal(images, sample(prepared, jax.random.key(4), LABELS)[0])


def test_stack_blocks_and_block_views_give_back_each_block():
  block = lambda i: {'dense': {'kernel': jnp.full((2, 3), float(i)), 'bias': jnp.full((3,), -float(i))}}
  tree = {'inner': {f'blocks_{i}': block(i) for i in range(3)}, 'blocks_0': block(7), 'head': {'kernel': jnp.ones(2)}}
  stacked = scan_module.stack_blocks(tree, ('blocks',))
  assert sorted(stacked['inner']) == ['blocks_stacked'] and 'blocks_0' in stacked   # a list of one stays
  assert stacked['inner']['blocks_stacked']['dense']['kernel'].shape == (3, 2, 3)
  views = scan_module.block_views(stacked)
  for i in range(3):
    jax.tree.map(np.testing.assert_array_equal, views['inner'][f'blocks_{i}'], block(i))
  jax.tree.map(np.testing.assert_array_equal, views['blocks_0'], block(7))


def test_runs_group_blocks_that_compute_alike_with_caches_of_one_length():
  alone = BlockHooks()
  pruned = [FastVARHooks(str(i), 2, 4) for i in range(5)]
  assert scan_module.cache_runs(None, (3, 3, 3, 3)) == [[0, 1, 2, 3]]
  assert scan_module.cache_runs([None, alone, alone, None, None], (3,) * 5) == [[0], [1], [2], [3, 4]]
  assert scan_module.cache_runs(None, (3, 3, 2, 2, 3)) == [[0, 1], [2, 3], [4]]
  assert scan_module.cache_runs([None] + pruned[1:4] + [None], (3,) * 5) == [[0], [1, 2, 3], [4]]
  assert scan_module.cache_runs(pruned[:2] + [FastVARHooks('2', None, 4)] + pruned[3:], (3,) * 5) == [[0, 1], [2], [3, 4]]


def test_scan_blocks_takes_only_consecutive_layers():
  with pytest.raises(ValueError, match='consecutive, got \\[0, 2\\]'):
    scan_module.scan_blocks([nn.Dense(2), nn.Dense(2), nn.Dense(2)], [0, 2], None, None, None)


def test_the_fastvar_blocks_of_a_pruned_scale_run_as_one_scan(deep_var, monkeypatch):
  """FastVAR prunes in blocks 1-3 at its last two scales: those blocks are one scan (one qkv GEMM
  of `keep` rows), the plain blocks 0 and 4 around them run alone (XLA's GEMMs counted: the
  stacked-weight kernel left out)."""
  var_cfg, vq_cfg, params = deep_var
  policy = FastVAR(ratios=((3, 0.5), (4, 0.5)), cache_at=2, blocks=(1, 2, 3))
  monkeypatch.setattr(importlib.import_module('pallas_kernels.layer_dense'), 'AUTO_MAX_ROWS', 0)
  with pk.override('interpret'):
    qkv = _qkv_dots(make_sampler(var_cfg, vq_cfg, policy, scan_blocks=True).lower(params, jax.random.key(0), LABELS),
                    var_cfg.width)
  keep = {3: 9 - int(9 * 0.5), 4: 16 - int(16 * 0.5)}
  for side, k in keep.items():
    assert sum(ln.endswith(f'x{k}x{3 * var_cfg.width}xf32>') for ln in qkv) == 1, side
    assert sum(ln.endswith(f'x{side * side}x{3 * var_cfg.width}xf32>') for ln in qkv) == 2, side


def test_a_layer_slot_writes_the_new_keys_in_place_and_attends_over_exactly_its_own():
  caches = LayerKVCaches.create(3, 2, 9, 1, 4, jnp.float32).with_lengths((2, 2, 1))
  caches = LayerKVCaches(caches.k + jnp.arange(3.0)[:, None, None, None, None], caches.v + 2, caches.lengths)
  slot = caches.layer(jnp.int32(1), 2)
  keys, values, kv_len, slot = slot.attend(jnp.full((2, 3, 1, 4), 7.0), jnp.full((2, 3, 1, 4), 8.0), None)
  assert keys.shape == values.shape == (2, 5, 1, 4) and kv_len is None and slot.length == 5
  np.testing.assert_array_equal(keys[:, :2], 1.0)
  np.testing.assert_array_equal(keys[:, 2:], 7.0)
  out = caches.put(slot)
  want_k = np.broadcast_to(np.arange(3.0)[:, None, None, None, None], (3, 2, 9, 1, 4)).copy()
  want_k[1, :, 2:5] = 7.0
  np.testing.assert_array_equal(out.k, want_k)
  assert out.v[1, 0, 4, 0, 0] == 8.0 and out.v[1, 0, 5, 0, 0] == 2.0 and out.lengths == (2, 2, 1)
  assert caches.layer(2).length == 1   # an int's length from `lengths`
  with pytest.raises(ValueError, match='overflow'):
    caches.layer(0).attend(jnp.ones((2, 8, 1, 4)), jnp.ones((2, 8, 1, 4)), None)


def test_scanned_dense_layers_read_the_stacked_weights_in_place(deep_var, monkeypatch):
  """Under the Pallas kernels (interpret mode), every Dense of a scanned block is
  `pallas_kernels.layer_dense` on the stacked weights; the images stay the unrolled ones."""
  var_cfg, vq_cfg, params = deep_var
  unrolled = _both(var_cfg, vq_cfg, params)[0]
  stacks, kernel = [], pk.layer_dense

  def layer_dense(x, w, b, layer, **kw):
    stacks.append(w.shape)
    return kernel(x, w, b, layer, **kw)
  monkeypatch.setattr(scan_module.pk, 'layer_dense', layer_dense)
  with pk.override('interpret'):
    scanned = make_sampler(var_cfg, vq_cfg, scan_blocks=True, return_fhats=True)(
        params, jax.random.key(4), LABELS, cfg=1.5, top_k=0, top_p=1.0)
  c = var_cfg.width
  assert set(stacks) == {(5, c, 3 * c), (5, c, c), (5, c, 4 * c), (5, 4 * c, c)}
  assert len(stacks) == 4 * len(var_cfg.patch_nums)    # traced once per scale
  _assert_same(unrolled, scanned)
