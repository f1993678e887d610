"""MAR sampling policies: neutral hooks and plans change nothing, caches thread through the
scan, a skipped unconditional half comes from the policy, bad plans are rejected."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from var_models.mar.policy import IterPlan, MARPolicy
from var_models.mar.sampler import make_mar_sampler
from var_models.mar.schedule import mask_schedule
from var_models.nn import tokens as tok
from var_models.nn.blocks import BlockHooks
from test_mar_sampler import LABELS, MAR_CFG, VAE_CFG, _params

NUM_ITER = 4
OPTS = dict(cfg=3.0, temperature=1.0)


@pytest.fixture(scope='module')
def params():
  return _params(MAR_CFG)


@pytest.fixture(scope='module')
def baseline_tokens(params):
  sample = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=NUM_ITER)
  return sample(params, jax.random.key(3), LABELS, **OPTS)[1]['tokens']


class _SegmentedNeutral(MARPolicy):
  """Every iteration its own plan (one scan each), a BlockHooks per block, and a state that
  poisons z unless it saw the previous iteration (so it must thread through the scans)."""

  def plan(self, num_iter):
    return tuple(IterPlan(tag=i % 3) for i in range(num_iter))

  def init_state(self, batch):
    return {'prev': jnp.int32(-2), 'cur': jnp.int32(-1)}

  def begin(self, plan, info, state):
    return {'prev': state['cur'], 'cur': info.step}

  def guide(self, site, halves, state):
    seen = state['prev'] == state['cur'] - 1
    return tuple(jnp.where(seen, h, jnp.nan) for h in halves.both()), state

  def block_hooks(self, site, depth):
    assert site.stack in ('encoder', 'decoder') and site.plan.tag in (0, 1, 2)
    return [BlockHooks() for _ in range(depth)]


class _EveryPositionNeutral(_SegmentedNeutral):
  def plan(self, num_iter):
    return tuple(IterPlan(tag=i % 3, every_position=True) for i in range(num_iter))


def test_neutral_hooks_segmented_plans_and_threaded_state_equal_the_baseline(params, baseline_tokens):
  sample = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=NUM_ITER, policy=_SegmentedNeutral())
  np.testing.assert_array_equal(sample(params, jax.random.key(3), LABELS, **OPTS)[1]['tokens'], baseline_tokens)


def test_neutral_hooks_of_plans_on_every_position_equal_that_baseline(params):
  """Plans that ask for every position (`IterPlan.every_position`) hand their hooks the unknown
  ones too, hidden as keys: the baseline of encoder_sizes=None."""
  want = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=NUM_ITER, encoder_sizes=None)(
      params, jax.random.key(3), LABELS, **OPTS)[1]['tokens']
  sample = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=NUM_ITER, policy=_EveryPositionNeutral())
  assert sample.encoder_lengths == (None,) * NUM_ITER
  np.testing.assert_array_equal(sample(params, jax.random.key(3), LABELS, **OPTS)[1]['tokens'], want)


class _KVCacheHooks(BlockHooks):
  """Forwards every token by index and attends through a per-block K/V cache in the state."""

  def __init__(self, block):
    self.block = block

  def select(self, site, x, state):
    b, l = x.shape[:2]
    return jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l)), state

  def kv(self, k, v, idx, state):
    ck, cv = state['k'][self.block], state['v'][self.block]
    ck, cv = tok.scatter(ck, idx, k.reshape(k.shape[:2] + (-1,))), tok.scatter(cv, idx, v.reshape(v.shape[:2] + (-1,)))
    state = {'k': state['k'].at[self.block].set(ck), 'v': state['v'].at[self.block].set(cv)}
    return ck.reshape(k.shape), cv.reshape(v.shape), state


class _DecoderKVCache(MARPolicy):
  """Caches the K/V of every decoder row: both CFG halves when bound to a guided sampler."""

  def __init__(self, rows_per_sample=None):
    self.rows_per_sample = rows_per_sample

  def bind(self, binding):
    return _DecoderKVCache(2 if binding.guided else 1)

  def init_state(self, batch):
    c = MAR_CFG
    shape = (c.decoder_depth, self.rows_per_sample * batch, c.buffer_size + c.seq_len, c.decoder_embed_dim)
    return {'k': jnp.zeros(shape), 'v': jnp.zeros(shape)}

  def block_hooks(self, site, depth):
    return [_KVCacheHooks(i) for i in range(depth)] if site.stack == 'decoder' else None


def test_tokens_forwarded_by_index_attending_through_a_kv_cache_equal_the_baseline(params, baseline_tokens):
  sample = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=NUM_ITER, policy=_DecoderKVCache())
  tokens = sample(params, jax.random.key(3), LABELS, **OPTS)[1]['tokens']
  np.testing.assert_allclose(tokens, baseline_tokens, rtol=1e-5, atol=1e-5)


class _CondOnly(MARPolicy):
  """Never runs the unconditional half: it copies the conditional one."""

  def plan(self, num_iter):
    return (IterPlan(uncond=False),) * num_iter

  def guide(self, site, halves, state):
    cond = halves.cond()
    return (cond, cond), state


def test_skipped_unconditional_half_comes_from_the_policy(params):
  # With both halves equal guidance is the identity: the same as guidance 1.
  skip = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=NUM_ITER, policy=_CondOnly())
  ones = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=NUM_ITER)
  kw = dict(cfg=1.0, cfg_schedule='constant', temperature=1.0)
  got = skip(params, jax.random.key(5), LABELS, **{**kw, 'cfg': 4.0})[1]['tokens']
  want = ones(params, jax.random.key(5), LABELS, **kw)[1]['tokens']
  # Tokens up to ~5e4 (a random head): cfg 1's u + (c - u) rounds at float32's ~1e-7 of that scale,
  # which a token of ~250 sees as ~1e-4 of its own (its digits differ with the CPU's vector width).
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * float(np.abs(want).max()))


def test_a_policy_that_skips_the_unconditional_half_must_say_how_to_make_it(params):
  class Skips(MARPolicy):
    def plan(self, num_iter):
      return (IterPlan(uncond=False),) * num_iter
  with pytest.raises(ValueError, match='Skips: only the conditional half.*override `guide`'):
    make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=NUM_ITER, policy=Skips())(params, jax.random.key(0), LABELS, **OPTS)


def test_a_plan_of_the_wrong_length_is_rejected():
  class Short(MARPolicy):
    def plan(self, num_iter):
      return (IterPlan(),) * (num_iter - 1)
  with pytest.raises(ValueError, match='one IterPlan per iteration'):
    make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=NUM_ITER, policy=Short())


def test_the_policy_is_bound_to_the_config_the_sampler_schedule_and_guidance():
  seen = []

  class Binds(MARPolicy):
    def bind(self, binding):
      seen.append(binding)
      return self
  sample = make_mar_sampler(MAR_CFG, VAE_CFG, num_iter=NUM_ITER, guided=False, num_diffusion_steps=7,
                            policy=Binds())
  (binding,) = seen
  assert binding.model is MAR_CFG and binding.schedule is sample.schedule and not binding.guided
  assert binding.schedule.num_iter == NUM_ITER and binding.schedule.diffusion_steps == 7
  np.testing.assert_array_equal(binding.schedule.mask.n_pred, mask_schedule(MAR_CFG.seq_len, NUM_ITER).n_pred)
