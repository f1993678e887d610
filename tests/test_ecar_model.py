"""E-CAR's networks and sampler: the KV-cache AR equals the block-causal forward, determinism, CFG and
policy hooks, the no-AR ablation, clear errors."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ecar
from ecar.config import ECARConfig
from ecar.model import ARTransformer, ECAR
from var_models.nn import blocks

CFG = ECARConfig(image_size=8, num_classes=4, latent_space='pixel', num_stages=3, patch_size=1, ar_depth=2,
                 ar_width=32, ar_heads=2, den_depth=1, den_width=32, den_heads=2)
LABELS = np.array([0, 3, 1], np.int32)


def _perturbed(params, scale=0.1):
  """The zero-initialised adaLN and output layers made non-zero, so every path carries signal."""
  rng = np.random.default_rng(42)
  return jax.tree_util.tree_map(lambda p: p + scale * rng.normal(size=p.shape).astype(np.float32), params)


@functools.lru_cache(maxsize=None)
def _ar_fn(cfg):
  return jax.jit(lambda p, labels, ends: ARTransformer(cfg).apply({'params': p}, labels, ends))


def _ar(cfg, params, labels, ends):
  """The teacher-forced (block-causal) AR forward, compiled once per config."""
  return _ar_fn(cfg)(params['ar'], jnp.asarray(labels), ends)


@pytest.fixture(scope='module')
def params():
  return _perturbed(ecar.init_params(CFG, jax.random.key(0)))


@pytest.fixture(scope='module')
def sampled(params):
  """(sampler, images, aux) at 2 Euler steps per stage, cfg 2."""
  sample = ecar.make_sampler(CFG, num_steps=6, return_intermediates=True)
  images, aux = sample({'ecar': params}, jax.random.key(1), LABELS, cfg=2.0)
  return sample, images, aux


def test_kv_cache_tokens_equal_the_block_causal_forward(params, sampled):
  _, images, aux = sampled
  forced = _ar(CFG, params, LABELS, aux['ends'][:-1])
  for s, (b, e) in enumerate(CFG.begin_ends):
    np.testing.assert_allclose(aux['r'][s], forced[:, b:e], rtol=1e-4, atol=1e-4)
  assert float(jnp.std(forced)) > 0.1
  np.testing.assert_allclose(images, np.clip((np.asarray(aux['ends'][-1]) + 1) / 2, 0, 1), atol=1e-6)
  assert images.shape == (3, 8, 8, 3)


def test_block_causal_mask_hides_later_stages(params):
  """Stage s's token maps do not change when a later stage's input changes."""
  ends = [jax.random.normal(jax.random.key(i), (3, g, g, 3)) for i, g in enumerate(CFG.stage_sizes[:-1])]
  a, b = _ar(CFG, params, LABELS, ends), _ar(CFG, params, LABELS, [ends[0], ends[1] + 1.0])
  first, second = CFG.begin_ends[1][1], CFG.begin_ends[2][0]
  np.testing.assert_allclose(a[:, :first], b[:, :first], atol=1e-6)
  assert float(jnp.max(jnp.abs(a[:, second:] - b[:, second:]))) > 1e-3


def test_same_key_same_images_other_key_other_images(params, sampled):
  sample, images, _ = sampled
  again, _ = sample({'ecar': params}, jax.random.key(1), LABELS, cfg=2.0)
  other, _ = sample({'ecar': params}, jax.random.key(2), LABELS, cfg=2.0)
  np.testing.assert_array_equal(images, again)
  assert float(jnp.max(jnp.abs(images - other))) > 1e-3


class _CondOnly(ecar.StagePolicy):
  """Runs only the conditional half of the denoiser and gives it as both halves: CFG at scale 1 by
  another route."""

  def guide(self, site, halves, state):
    v_c = halves.cond()
    return (v_c, v_c), state


def test_merged_adaln_gives_the_per_block_velocity():
  """The sampler's one adaLN GEMM per step (every block's and the final layer's modulation
  concatenated) computes what each block's own adaLN Linear does (non-zero weights, 2 blocks)."""
  cfg = dataclasses.replace(CFG, den_depth=(1, 2, 1))
  p = _perturbed(ecar.init_params(cfg, jax.random.key(2)))
  s, g, n = 1, cfg.stage_sizes[1], cfg.stage_tokens[1]
  x = jax.random.normal(jax.random.key(0), (2, g, g, 3))
  cond = jax.random.normal(jax.random.key(1), (2, n, cfg.den_width))
  ts = jnp.array([100.0, 700.0])
  vel = lambda adaln: ECAR(cfg).apply({'params': p}, s, x, ts, cond, adaln, method=ECAR.den_velocity)
  merged = ecar.layers.merged_adaln(p['denoiser_1'])
  assert merged[0].shape == (cfg.den_width, (6 * 2 + 2) * cfg.den_width)
  np.testing.assert_allclose(vel(merged), vel(None), rtol=1e-5, atol=1e-5)


def test_euler_step_guidance_and_the_cond_only_hook(params):
  """Step s of 4: x + (v_u + scale * (v_c - v_u)) / 4 on the doubled batch; a policy running the
  conditional half alone gives the scale-1 step."""
  from ecar.sampler import make_sampler
  s, g, n = 1, CFG.stage_sizes[1], CFG.stage_tokens[1]
  base, hooked = make_sampler(CFG, num_steps=(4, 4, 4)), make_sampler(CFG, num_steps=(4, 4, 4), policy=_CondOnly())
  x = jax.random.normal(jax.random.key(0), (3, g, g, 3))
  cond = jax.random.normal(jax.random.key(1), (6, n, CFG.den_width))

  @jax.jit
  def run(p, x, cond):
    v = {'params': p}
    step = lambda sampler, scale: sampler.euler_step(v, s, jnp.int32(2), x, cond, jnp.float32(scale), None)[0]
    ts = ecar.flow.timestep(base.flow, s, jnp.full((6,), 0.5))
    vel = ECAR(CFG).apply(v, s, jnp.concatenate([x, x]), ts, cond, method=ECAR.den_velocity)
    return step(base, 4.0), step(base, 1.0), step(hooked, 1.0), vel

  guided, plain, cond_only, vel = run(params, x, cond)
  v_c, v_u = vel[:3], vel[3:]
  np.testing.assert_allclose(guided, x + (v_u + 4.0 * (v_c - v_u)) / 4, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(plain, x + v_c / 4, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cond_only, plain, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(v_c - v_u))) > 1e-3


def test_adaln_outputs_computed_before_each_flow_loop_give_the_per_step_images(params, monkeypatch):
  """Every Euler step's adaLN outputs in one GEMM before each stage's loop, or one GEMM a step: the
  same images, through the doubled batch on full steps and the conditional half alone on the
  condition cache's others."""
  from accel.ecar_caches import ECARConditionCache
  images = {}
  for rows in (0, 10**6):
    monkeypatch.setattr(blocks, 'ADALN_AHEAD_MAX_ROWS', rows)
    sample = ecar.make_sampler(CFG, num_steps=(3, 3, 3), policy=ECARConditionCache(interval=2))
    images[rows] = sample({'ecar': params}, jax.random.key(1), LABELS, cfg=2.0)[0]
  np.testing.assert_allclose(images[10**6], images[0], rtol=1e-5, atol=1e-5)


def test_no_ar_ablation_conditions_every_stage_on_the_class_only():
  cfg = dataclasses.replace(CFG, ar_depth=0)
  ends = [jax.random.normal(jax.random.key(i), (3, g, g, 3)) for i, g in enumerate(cfg.stage_sizes[:-1])]
  init = jax.jit(lambda k: ARTransformer(cfg).init(k, jnp.asarray(LABELS), ends)['params'])
  p = {'ar': _perturbed(init(jax.random.key(0)))}
  assert sorted(p['ar']) == ['class_emb', 'norm', 'pos_embed', 'stage_emb']
  base = _ar(cfg, p, LABELS, ends)
  np.testing.assert_array_equal(base, _ar(cfg, p, LABELS, [e + 1.0 for e in ends]))
  assert float(jnp.max(jnp.abs(base - _ar(cfg, p, LABELS[::-1], ends)))) > 1e-3


def test_sampler_rejects_bad_input(params):
  sample = ecar.make_sampler(CFG, num_steps=3)
  with pytest.raises(ValueError, match=r'labels must be in \[0, 4\)'):
    sample({'ecar': params}, jax.random.key(0), np.array([0, 4]), cfg=1.0)
  with pytest.raises(ValueError, match='cfg must be finite'):
    sample({'ecar': params}, jax.random.key(0), LABELS, cfg=float('nan'))
  with pytest.raises(ValueError, match='num_steps must be >= the number of stages'):
    ecar.make_sampler(CFG, num_steps=2)
  with pytest.raises(ValueError, match='one per stage'):
    ecar.make_sampler(CFG, num_steps=(2, 2))
  latent = ECARConfig(image_size=64, num_classes=4, patch_size=1, ar_depth=1, ar_width=32, ar_heads=2, den_depth=1,
                      den_width=32, den_heads=2)
  with pytest.raises(ValueError, match=r"params\['vae'\] is required"):
    ecar.make_sampler(latent, num_steps=3)({'ecar': params}, jax.random.key(0), LABELS, cfg=1.0)


def test_steps_split_a_third_per_stage():
  from ecar.sampler import split_steps
  assert split_steps(250, 3) == (84, 83, 83) and split_steps(6, 3) == (2, 2, 2)


def test_pixel_space_encode_decode_are_identity_like():
  x = jax.random.uniform(jax.random.key(0), (2, 8, 8, 3), minval=-1, maxval=1)
  np.testing.assert_array_equal(ecar.encode_images(CFG, None, x, jax.random.key(1)), x)
  np.testing.assert_allclose(ecar.decode(CFG, None, x), (x + 1) / 2, atol=1e-7)
  with pytest.raises(ValueError, match=r'images must be \[B, 8, 8, 3\]'):
    ecar.encode_images(CFG, None, x[:, :4], jax.random.key(1))


def test_model_forward_shapes(params):
  out = jax.eval_shape(lambda p, *a: ECAR(CFG).apply({'params': p}, *a), params, *ecar.model.dummy_inputs(CFG, 2))
  assert [o.shape for o in out] == [(2, g, g, 3) for g in CFG.stage_sizes]


def test_latent_space_shapes_through_the_sdxl_vae():
  """256 px images <-> 32 x 32 x 4 scaled latents, and the sampler's output, from shapes alone."""
  cfg = ECARConfig(num_classes=4, ar_depth=1, ar_width=32, ar_heads=2, den_depth=1, den_width=32, den_heads=2)
  vae = jax.eval_shape(lambda k: ecar.init_vae_params(cfg, k), jax.random.key(0))
  images = jax.ShapeDtypeStruct((2, 256, 256, 3), jnp.float32)
  x0 = jax.eval_shape(lambda v, x: ecar.encode_images(cfg, v, x, jax.random.key(0)), vae, images)
  assert x0.shape == (2, 32, 32, 4) == (2, *cfg.data_shape)
  assert jax.eval_shape(lambda v, x: ecar.decode(cfg, v, x), vae, x0).shape == (2, 256, 256, 3)
  params = ecar.model.abstract_params(cfg)
  sample = ecar.make_sampler(cfg, num_steps=3)
  out, _ = jax.eval_shape(lambda p, v: sample._sample({'ecar': p, 'vae': v}, jax.random.key(0),
                                                      jnp.zeros((2,), jnp.int32), jnp.float32(1.5)), params, vae)
  assert out.shape == (2, 256, 256, 3)


def test_sampling_flops_count_every_denoiser_weight_on_every_token_of_both_cfg_halves(params):
  base = ecar.sampling_flops(CFG, num_steps=(2, 2, 2))
  assert base['decode'] < base['per_image'] == base['per_image_without_decode'] + base['decode']
  for s in range(CFG.num_stages):
    steps = [2, 2, 2]
    steps[s] += 1
    step = ecar.sampling_flops(CFG, num_steps=tuple(steps))['per_image'] - base['per_image']
    # One more Euler step: each denoiser matrix multiplies all tokens of the doubled batch (2 FLOPs
    # per multiply-add); the time embedding runs per sample, the AR's condition once per stage.
    den = {k: v for k, v in params[f'denoiser_{s}'].items() if k not in ('t_embed', 'cond_proj')}
    weights = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(den) if path[-1].key == 'kernel')
    dense = 2 * 2 * CFG.stage_tokens[s] * weights
    assert dense <= step <= 1.5 * dense  # the rest: attention's q.k and p.v


@pytest.mark.parametrize('impl', ['reference', 'interpret'])
def test_chained_blocks_draw_each_blocks_images(monkeypatch, impl):
  """Two blocks a denoiser chained through `residual_norm` (its reference: the same operations, so
  the same bits; the kernel in interpret mode: float32 rounding) against each block whole, the
  adaLN outputs ahead in both; the condition cache's conditional-only steps included."""
  import pallas_kernels as pk
  from accel.ecar_caches import ECARConditionCache
  from ecar import model as ecar_model
  cfg = dataclasses.replace(CFG, den_depth=2)
  p = _perturbed(ecar.init_params(cfg, jax.random.key(0)))
  images = {}
  for rows in (0, 128):
    monkeypatch.setattr(ecar_model, 'CHAINED_MAX_ROWS', rows)
    with pk.override(impl):
      sample = ecar.make_sampler(cfg, num_steps=(3, 3, 3), policy=ECARConditionCache(interval=2))
      images[rows] = np.asarray(sample({'ecar': p}, jax.random.key(1), LABELS, cfg=2.0)[0])
  tolerance = 0 if impl == 'reference' else 1e-5
  np.testing.assert_allclose(images[128], images[0], rtol=0, atol=tolerance)
  assert images[0].std() > 0.1
