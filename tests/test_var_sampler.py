"""The KV-cache sampler: equal to teacher forcing, deterministic, policy hooks neutral, checked input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from var_models.nn.blocks import BlockHooks
from var_models.tokenizers.vqvae import VQVAE
from var_models.var.model import VAR
from var_models.var.policy import ScalePolicy, Step
from var_models.var.sampler import make_sampler, sample_top_k_top_p

LABELS = np.array([1, 7, 3], np.int32)


def _teacher_forced_logits(var_cfg, vq_cfg, params, labels, indices):
  x_tf = VQVAE(vq_cfg).apply({'params': params['vqvae']}, indices, method=VQVAE.indices_to_var_input)
  return VAR(var_cfg).apply({'params': params['var']}, jnp.asarray(labels), x_tf)


def test_kv_cache_logits_equal_teacher_forced_logits(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  sample = make_sampler(var_cfg, vq_cfg, return_logits=True)
  _, aux = sample(params, jax.random.key(0), LABELS, cfg=0.0, top_k=0, top_p=1.0)
  sampled = jnp.concatenate(aux['logits'], axis=1)
  forced = _teacher_forced_logits(var_cfg, vq_cfg, params, LABELS, aux['indices'])
  np.testing.assert_allclose(sampled, forced, rtol=1e-5, atol=1e-5)
  assert float(jnp.std(forced)) > 1e-2  # logits are informative, not ~constant


def test_cfg_combines_conditional_and_unconditional_logits(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  sample = make_sampler(var_cfg, vq_cfg, return_logits=True)
  cfg = 2.5
  _, aux = sample(params, jax.random.key(0), LABELS, cfg=cfg, top_k=0, top_p=1.0)
  cond = _teacher_forced_logits(var_cfg, vq_cfg, params, LABELS, aux['indices'])
  uncond = _teacher_forced_logits(var_cfg, vq_cfg, params, np.full_like(LABELS, var_cfg.num_classes),
                                  aux['indices'])
  sched = var_cfg.schedule
  for si, (b, e) in enumerate(sched.begin_ends):
    t = cfg * si / (sched.num_scales - 1)
    expected = (1 + t) * cond[:, b:e] - t * uncond[:, b:e]
    np.testing.assert_allclose(aux['logits'][si], expected, rtol=1e-4, atol=1e-4)


def test_f_hat_and_images_follow_sampled_indices(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  sample = make_sampler(var_cfg, vq_cfg, return_fhats=True)
  images, aux = sample(params, jax.random.key(3), LABELS, cfg=1.5, top_k=5, top_p=0.9)
  vq = VQVAE(vq_cfg)
  qp = {'params': params['vqvae']}
  f_hats = vq.apply(qp, aux['indices'], return_all=True, method=VQVAE.indices_to_fhat)
  for got, want in zip(aux['f_hats'], f_hats):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  expected = (vq.apply(qp, f_hats[-1], method=VQVAE.fhat_to_img) + 1) / 2
  np.testing.assert_allclose(images, expected, rtol=1e-5, atol=1e-5)
  assert images.shape == (3, vq_cfg.image_size, vq_cfg.image_size, 3)
  assert float(images.min()) >= 0 and float(images.max()) <= 1


def test_same_key_same_images_other_key_other_indices(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  sample = make_sampler(var_cfg, vq_cfg)
  a, aux_a = sample(params, jax.random.key(5), LABELS, cfg=1.0)
  b, _ = sample(params, jax.random.key(5), LABELS, cfg=1.0)
  _, aux_c = sample(params, jax.random.key(6), LABELS, cfg=1.0)
  np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(x, y) for x, y in zip(aux_a['indices'], aux_c['indices']))


def _official_filter(logits, top_k, top_p):
  """NumPy transcription of the official top-k then top-p rule, row by row."""
  out = logits.copy()
  for row in out.reshape(-1, out.shape[-1]):
    if top_k > 0:
      row[row < np.sort(row)[-top_k]] = -np.inf
    if top_p > 0:
      order = np.argsort(row, kind='stable')
      p = np.exp(row[order] - row[order].max())
      remove = np.cumsum(p / p.sum()) <= 1 - top_p
      remove[-1] = False
      row[order[remove]] = -np.inf
  return out


@pytest.mark.parametrize('top_k,top_p', [(0, 0.5), (7, 1.0), (7, 0.8), (1, 0.3), (64, 0.96), (0, 1.0)])
def test_top_k_top_p_draws_follow_the_official_filtered_distribution(top_k, top_p):
  logits = np.asarray(jax.random.normal(jax.random.key(top_k), (3, 64)) * 2, np.float32)
  allowed = np.isfinite(_official_filter(logits, top_k, top_p))
  probs = np.where(allowed, np.exp(logits - logits.max(-1, keepdims=True)), 0)
  probs /= probs.sum(-1, keepdims=True)
  n = 20000
  draws = jax.vmap(lambda k: sample_top_k_top_p(k, jnp.asarray(logits), top_k, top_p))(
      jax.random.split(jax.random.key(1), n))
  draws = np.asarray(draws)  # [n, 3]
  for row in range(3):
    freq = np.bincount(draws[:, row], minlength=64) / n
    assert allowed[row][draws[:, row]].all(), 'drew a token the official filter removes'
    tol = 4 * np.sqrt(probs[row] * (1 - probs[row]) / n) + 1e-3
    assert np.all(np.abs(freq - probs[row]) <= tol), np.abs(freq - probs[row]).max()


def test_top_k_one_is_greedy(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  sample = make_sampler(var_cfg, vq_cfg, return_logits=True)
  _, aux = sample(params, jax.random.key(0), LABELS, cfg=1.5, top_k=1)
  for idx, lg in zip(aux['indices'], aux['logits']):
    np.testing.assert_array_equal(idx, jnp.argmax(lg, axis=-1))


class _NeutralHooks(ScalePolicy):
  """Hooks at every block that forward everything: must change nothing in the program."""

  def block_hooks(self, site, depth):
    return [BlockHooks() for _ in range(depth)]


class _KeepAllByIndex(ScalePolicy):
  """Selects every token through explicit (reversed) indices at the input and in every
  sub-layer: exercises gather/scatter and must equal the baseline."""

  class _Hooks(BlockHooks):
    def select(self, site, x, state):
      b, n = x.shape[:2]
      return jnp.broadcast_to(jnp.arange(n)[::-1], (b, n)), state

  def select_input(self, site, x, state):
    b, n = x.shape[:2]
    return jnp.broadcast_to(jnp.arange(n), (b, n)), state

  def block_hooks(self, site, depth):
    return [self._Hooks() for _ in range(depth)]


def test_neutral_hooks_compile_to_the_baseline_program(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  args = (params, jax.random.key(0), LABELS)
  base = make_sampler(var_cfg, vq_cfg).lower(*args).as_text()
  hooked = make_sampler(var_cfg, vq_cfg, _NeutralHooks()).lower(*args).as_text()
  assert base == hooked


def test_policy_keeping_every_token_equals_baseline(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  base, aux_b = make_sampler(var_cfg, vq_cfg)(params, jax.random.key(1), LABELS, cfg=1.5)
  kept, aux_k = make_sampler(var_cfg, vq_cfg, _KeepAllByIndex())(params, jax.random.key(1), LABELS, cfg=1.5)
  for x, y in zip(aux_b['indices'], aux_k['indices']):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_allclose(base, kept, rtol=1e-6, atol=1e-6)


class _CondOnly(ScalePolicy):
  """Guides with the conditional half as both halves (no guidance); its state counts the calls."""

  def __init__(self):
    self.seen = []   # (step index, state) at each after_step, while tracing

  def init_state(self, batch):
    return 0

  def guide(self, site, halves, state):
    cond, _ = halves.both()
    return (cond, cond), state + 1

  def after_step(self, site, f_hat, state):
    self.seen.append((site.index, state))
    return state


def test_the_policys_guide_gives_the_halves_the_sampler_mixes_and_its_state_goes_on(tiny_var):
  var_cfg, vq_cfg, params = tiny_var
  policy = _CondOnly()
  args = (params, jax.random.key(0), LABELS)
  _, aux = make_sampler(var_cfg, vq_cfg, policy, return_logits=True)(*args, cfg=1.5, top_k=1)
  _, plain = make_sampler(var_cfg, vq_cfg, return_logits=True)(*args, cfg=0.0, top_k=1)
  for got, want in zip(aux['logits'], plain['logits'], strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert policy.seen == [(0, 1), (1, 2), (2, 3), (3, 4)]


class _TwoScalesAtOnce(ScalePolicy):
  def plan(self, sched):
    return (Step((0,)), Step((1,)), Step((2, 3)))


def test_multi_scale_step_uses_scale_causal_mask(tiny_var):
  """Decoding scales 2 and 3 in one forward: scale 2's logits equal the baseline's."""
  var_cfg, vq_cfg, params = tiny_var
  sample = make_sampler(var_cfg, vq_cfg, _TwoScalesAtOnce(), return_logits=True)
  _, aux = sample(params, jax.random.key(2), LABELS, cfg=0.0, top_k=1)
  forced = _teacher_forced_logits(var_cfg, vq_cfg, params, LABELS, aux['indices'])
  b, e = var_cfg.schedule.begin_ends[2]
  np.testing.assert_allclose(aux['logits'][2], forced[:, b:e], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('kwargs,message', [
    (dict(labels=np.array([0, 10])), 'labels must be in'),
    (dict(labels=np.array([-1])), 'labels must be in'),
    (dict(cfg=-0.5), 'cfg must be >= 0'),
    (dict(top_k=65), 'top_k must be in'),
    (dict(top_k=-1), 'top_k must be in'),
    (dict(top_p=0.0), 'top_p must be in'),
    (dict(top_p=1.5), 'top_p must be in'),
])
def test_bad_sampling_arguments_raise_before_compiling(tiny_var, kwargs, message):
  var_cfg, vq_cfg, params = tiny_var
  sample = make_sampler(var_cfg, vq_cfg)
  args = dict(labels=LABELS, cfg=1.0, top_k=0, top_p=1.0) | kwargs
  with pytest.raises(ValueError, match=message):
    sample(params, jax.random.key(0), args.pop('labels'), **args)
  assert sample._jitted._cache_size() == 0


def test_plan_that_skips_the_first_scale_is_rejected(tiny_var):
  var_cfg, vq_cfg, _ = tiny_var

  class Bad(ScalePolicy):
    def plan(self, sched):
      return (Step((1,)), Step((2,)))

  with pytest.raises(ValueError, match='must start with scale 0'):
    make_sampler(var_cfg, vq_cfg, Bad())
