"""FastVAR: PTS scores, keep counts and restoration against hand-computed cases, the hooked block against a
plain restatement, the sampler against the baseline (keep-all bit for bit, skipped scales draw nothing), the
presets' settings and the errors of bad ones."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from accel import FastVAR, FastVARHooks, keep_count, pivotal_tokens, restore_tokens
from accel.fastvar import pts_scores
from var_models.nn.attention import KVCache
from var_models.nn.blocks import AdaLNSelfAttn, modulate, trunc_normal
from var_models.tokenizers.vqvae import VQVAE
from var_models.var.model import VARConfig
from var_models.var.policy import Site, var_binding
from var_models.var.sampler import make_sampler
from var_models.var.schedules import INFINITY_1024, VAR_256

LABELS = np.array([1, 7, 3], np.int32)


def _binding(sched, depth):
  """What the sampler of a depth-block VAR on sched binds its policy to."""
  return var_binding(VARConfig(depth=depth, patch_nums=sched.patch_nums))


def test_keep_count_is_l_minus_int_l_times_ratio():
  assert keep_count(1024, 0.4) == 615 and keep_count(1600, 0.5) == 800  # Infinity-2B's 32 and 40
  assert keep_count(4096, 0.75) == 1024 and keep_count(1, 0.9) == 1 and keep_count(10, 0.0) == 10
  assert keep_count(10, 0.3) == 7  # 10 * 0.3 = 3.0000000000000004 in floating point


def test_pivotal_tokens_rank_each_rows_distance_from_its_mean_ties_to_the_lower_index():
  x = jnp.array([[[0, 0], [2, 0], [0, 0], [0, -2]],     # mean (0.5, -0.5): scores .5, 2.5, .5, 2.5
                 [[5, 1], [1, 1], [1, 1], [1, 1]]],     # mean (2, 1): scores 9, 1, 1, 1
                jnp.float32)
  np.testing.assert_allclose(pts_scores(x), [[0.5, 2.5, 0.5, 2.5], [9, 1, 1, 1]])
  np.testing.assert_array_equal(pivotal_tokens(x, 3), [[1, 3, 0], [0, 1, 2]])   # descending scores
  np.testing.assert_array_equal(pivotal_tokens(x, 1), [[1], [0]])
  np.testing.assert_array_equal(pivotal_tokens(x, 4), [[0, 1, 2, 3], [0, 1, 2, 3]])  # all: in order


def test_pts_scores_match_float64_and_pick_the_outliers():
  x = np.random.default_rng(8).standard_normal((2, 30, 16))
  x[:, [3, 17]] += 10.0            # two tokens far from the mean
  got = pts_scores(jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), ((x - x.mean(1, keepdims=True)) ** 2).sum(-1), rtol=1e-5)
  assert all(set(np.asarray(i).tolist()) == {3, 17} for i in pivotal_tokens(jnp.asarray(x, jnp.float32), 2))


def test_restore_area_resizes_the_cache_and_writes_the_computed_rows():
  cached = jnp.array([[1, 2, 3, 4], [0, 0, 0, 8]], jnp.float32)[..., None]   # two 2 x 2 maps
  y = jnp.array([[10, 20], [-1, -2]], jnp.float32)[..., None]
  idx = jnp.array([[0, 4], [8, 1]])
  # PyTorch 'area' 2 -> 3 averages the windows [0, 1), [0, 2), [1, 2) on each axis.
  want = [[10, 1.5, 2, 2, 20, 3, 3, 3.5, 4], [0, -2, 0, 0, 2, 4, 0, 4, -1]]
  np.testing.assert_allclose(restore_tokens(cached, 3, y, idx)[..., 0], want)


def _block_and_params(width=16, heads=2):
  block = AdaLNSelfAttn(width, heads, 4.0, 1e-6, True, False, 0.0, trunc_normal(0.3), trunc_normal(0.3),
                        trunc_normal(0.3))
  mod = jax.random.normal(jax.random.key(1), (2, 6, width))
  x = jax.random.normal(jax.random.key(2), (2, 4, width))
  return block, block.init(jax.random.key(0), x, mod), mod


def _sublayers(block, variables, mod):
  """The block's two sub-layers (norm, modulation, branch, gamma) as functions of the tokens they get."""
  g1, g2, s1, s2, b1, b2 = [m[:, None] for m in jnp.moveaxis(mod, 1, 0)]

  def attn(h, kv):
    out, kv, _ = block.apply(variables, h, kv, method=lambda m, h, kv: m.attn(modulate(m.ln(h), s1, b1), kv=kv))
    return out * g1, kv

  def ffn(h):
    return block.apply(variables, h, method=lambda m, h: m.ffn(modulate(m.ln(h), s2, b2))) * g2
  return attn, ffn


def _restated_pruned_sublayer(run, x, cached, keep, side):
  """Plain restatement: stable descending sort of the scores, the first `keep`; area-resized cache."""
  scores = np.sum((np.asarray(x) - np.asarray(x).mean(1, keepdims=True)) ** 2, -1)
  idx = np.argsort(-scores, axis=1, kind='stable')[:, :keep]
  rows, extra = run(np.take_along_axis(np.asarray(x), idx[..., None], 1))
  m = np.zeros((side, 2))
  m[:, 0], m[:, 1] = [1, 0.5, 0], [0, 0.5, 1]          # area 2 -> 3
  y = np.einsum('ph,qw,bhwc->bpqc', m, m, np.asarray(cached).reshape(2, 2, 2, -1)).reshape(2, side * side, -1)
  np.put_along_axis(y, idx[..., None], np.asarray(rows), 1)
  return x + y, extra


def test_hooked_block_equals_a_restatement_selecting_before_each_sublayer_and_restoring_before_each_add():
  block, variables, mod = _block_and_params()
  attn, ffn = _sublayers(block, variables, mod)
  x_c = jax.random.normal(jax.random.key(3), (2, 4, 16))   # cache scale, 2 x 2
  x_p = jax.random.normal(jax.random.key(4), (2, 9, 16))   # pruned scale, 3 x 3, keep 5
  kv0 = KVCache.create(2, 13, 2, 8, jnp.float32)
  out_c, kv, state = block.apply(variables, x_c, mod, kv=kv0, hooks=FastVARHooks('0'), state={})
  out_p, kv, state = block.apply(variables, x_p, mod, kv=kv, hooks=FastVARHooks('0', 5, 3), state=state)

  a, kv_r = attn(x_c, kv0)
  f = ffn(x_c + a)
  np.testing.assert_allclose(state['0/attn'], a, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(state['0/ffn'], f, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out_c, x_c + a + f, rtol=1e-6, atol=1e-6)
  x1, kv_r = _restated_pruned_sublayer(lambda h: attn(h, kv_r), x_p, a, 5, 3)
  want, _ = _restated_pruned_sublayer(lambda h: (ffn(h), None), x1, f, 5, 3)
  np.testing.assert_allclose(out_p, want, rtol=1e-5, atol=1e-5)
  assert kv.length == kv_r.length == 4 + 5       # only the kept tokens' keys and values are cached
  np.testing.assert_allclose(kv.keys(), kv_r.keys(), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope='module')
def baseline(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  return make_sampler(var_cfg, vq_cfg, return_fhats=True)(params, jax.random.key(1), LABELS, cfg=1.5)


def test_policy_keeping_every_token_is_bit_identical_to_the_baseline(tiny_var, baseline):
  """Ratio 0 runs the scores, the gather, the restoration from the cache and the scatter, keeping all."""
  var_cfg, vq_cfg, params = tiny_var
  keep_all = FastVAR(ratios=((3, 0.0), (4, 0.0)), cache_at=2)
  images, aux = make_sampler(var_cfg, vq_cfg, keep_all, return_fhats=True)(params, jax.random.key(1), LABELS,
                                                                           cfg=1.5)
  np.testing.assert_array_equal(images, baseline[0])
  for name in ('indices', 'f_hats'):
    for got, want in zip(aux[name], baseline[1][name], strict=True):
      np.testing.assert_array_equal(got, want)


def _count(jaxpr, name: str) -> int:
  """Equations of primitive `name` in jaxpr and every jaxpr nested in it."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == name
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else [v]):
        if hasattr(sub, 'eqns') or hasattr(sub, 'jaxpr'):
          n += _count(getattr(sub, 'jaxpr', sub), name)
  return n


def test_skipped_trailing_scale_is_not_run_and_the_image_decodes_from_f_hat(tiny_var, baseline):
  var_cfg, vq_cfg, params = tiny_var
  sample = make_sampler(var_cfg, vq_cfg, FastVAR(ratios=((4, 1.0),)), return_fhats=True)
  images, aux = sample(params, jax.random.key(1), LABELS, cfg=1.5)
  assert len(aux['indices']) == 3
  for got, want in zip(aux['indices'], baseline[1]['indices']):
    np.testing.assert_array_equal(got, want)
  qp = {'params': params['vqvae']}
  decoded = (VQVAE(vq_cfg).apply(qp, baseline[1]['f_hats'][2], method=VQVAE.fhat_to_img) + 1) / 2
  np.testing.assert_allclose(images, decoded, rtol=1e-6, atol=1e-6)
  draws = {}
  for name, s in (('skip', sample), ('base', make_sampler(var_cfg, vq_cfg))):
    jaxpr = jax.make_jaxpr(functools.partial(s._jitted, top_k=0, top_p=1.0))(
        params, jax.random.key(1), jnp.asarray(LABELS), jnp.float32(1.5))
    draws[name] = (_count(jaxpr.jaxpr, 'random_bits'), _count(jaxpr.jaxpr, 'random_split'))
  assert draws == {'base': (4, 4), 'skip': (3, 3)}


@pytest.mark.parametrize('make,message', [
    (lambda: FastVAR(ratios=((3, 1.5),), cache_at=2), r'FastVAR.ratios: the ratio of scale 3 must be in \[0, 1\]'),
    (lambda: FastVAR(ratios=((3, -0.1),), cache_at=2), r'FastVAR.ratios: the ratio of scale 3 must be in \[0, 1\]'),
    (lambda: FastVAR(ratios=((4, 0.5),)), 'FastVAR.cache_at: pruned scales'),
    (lambda: FastVAR(ratios=((2, 0.5),), cache_at=3), 'FastVAR.cache_at: the cache scale 3 must come before'),
    (lambda: FastVAR(ratios=((3, 1.0),)), 'FastVAR.ratios: only the last scales'),
    (lambda: FastVAR(ratios=((4, 0.5),), cache_at=3, blocks=(0, 2)), 'FastVAR.blocks: block 2 is past the depth 2'),
    (lambda: FastVAR(ratios=((4, 0.5),), cache_at=5), 'FastVAR.cache_at: scale 5 is not in the schedule'),
    (lambda: FastVAR.preset('infinity_2b'), 'FastVAR.ratios: scale 32 is not in the schedule'),
    (lambda: FastVAR.preset('var512'), "unknown FastVAR preset 'var512'"),
])
def test_bad_settings_are_errors_naming_the_field_before_anything_compiles(tiny_var, make, message):
  var_cfg, vq_cfg, _ = tiny_var
  with pytest.raises(ValueError, match=message):
    make_sampler(var_cfg, vq_cfg, make())


def test_presets_hold_the_published_settings():
  inf = FastVAR.preset('infinity_2b').bind(_binding(INFINITY_1024, 32))
  steps = inf.plan(INFINITY_1024)
  assert len(steps) == 11                                          # 48 and 64 are skipped
  hooks = inf.block_hooks(Site(9, steps[9]), 32)                   # the 32 x 32 scale
  assert [i for i, h in enumerate(hooks) if h is not None] == list(range(3, 28))
  assert hooks[3].keep == 615 and inf.block_hooks(Site(10, steps[10]), 32)[27].keep == 800
  assert all(h.keep is None for h in inf.block_hooks(Site(8, steps[8]), 32)[3:28])   # 24 x 24 caches
  hart = FastVAR.preset('hart').bind(_binding(INFINITY_1024, 16))
  assert len(hart.plan(INFINITY_1024)) == 13 and 'our mapping' in hart.source
  assert hart.block_hooks(Site(12, hart.plan(INFINITY_1024)[12]), 16)[15].keep == 1024
  var256 = FastVAR.preset('var256').bind(_binding(VAR_256, 30))
  assert len(var256.plan(VAR_256)) == 10 and var256.source.startswith('var256: ours')
