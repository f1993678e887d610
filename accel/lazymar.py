"""LazyMAR (Yan et al. 2025): MAR's feature caches, as the authors' code computes them.

    sample = make_mar_sampler(mar_cfg, vae_cfg, num_iter=64, policy=accel.LazyMAR.preset('official'))

Iterations are *full* (refreshes: both CFG halves, every token, every cache rebuilt) when
step < refresh_start or (step - refresh_start) % refresh_every == 0 (of 64: 0-5, 14, 23, 32,
41, 50, 59); the others are *cached*. Four caches, each of which can be switched off:
  - encoder: every iteration runs it on every position (the unknown ones hidden as keys, which
    gives the known tokens what MAR's encoder gives them on the known tokens alone; measured
    faster than the known positions gathered at a refresh, benchmarks/RESULTS.md); a refresh
    writes every position's K/V into a per-layer cache; a cached iteration forwards only the
    buffer and the tokens predicted at the previous iteration, writes their K/V at their
    positions and attends through the cache to the buffer and the known tokens; the decoder's
    input is cached too and refreshed only at those positions;
  - decoder (token cache): blocks before `similarity_block` and that block's attention run
    every position; then each position is scored by the mean over heads of cos(V_now, V_prev)
    of that block's attention, the positions predicted at this and the previous iteration
    score 0, and the n lowest scores (the least similar; stable: ties keep the lower position)
    are kept, n = max(#now + #prev + extra_tokens, int(L * ratio[step])), L = buffer + N
    positions, buffer positions candidates like any other. That block's MLP and every later
    block forward only the kept positions, whose K/V are scattered into each later block's
    cache; attention reads all L cached positions. Positions not kept leave the decoder as 0;
  - condition: a cached iteration runs the conditional half only; the unconditional decoder
    output (before the decoder norm) is cond + (uncond - cond) of the last refresh;
  - head (every iteration; its cache lives for one DiffLoss loop): loop step i (respaced
    timestep, T-1 down to 0) is *full* if i == T-1 or i % head_interval == 0 (both halves, every
    block; cache eps_c - eps_u, each block's MLP output, and the output - input of the
    `head_skip` blocks); otherwise the conditional half only, eps_u = eps_c - cached delta, the
    `head_skip` blocks add their cached delta, the other blocks add their cached MLP output
    under this step's adaLN gate, recomputing it only while i > head_warm * T.
The official code runs only with CFG and hard-codes the 64-iteration constants; `preset`
gives them ('official'), each cache alone, and 'scaled', which maps them onto any iteration
count by the fraction of sampling done: ratio[k] = official ratio at floor(64 k / num_iter),
refresh_start = ceil(5 num_iter / 64), refresh_every = max(1, round(9 num_iter / 64)) (at 64
iterations: exactly the official schedule).

Shapes are static: every count follows from the iteration schedule. A cached plan's tag is
the kept count padded to the largest one among the iterations of its ratio, and those sizes
merged into at most `decoder_sizes` (`merge_sizes`: the fewest padded rows), each one compiled
body of the iteration loop; padding rows and the padded predicted positions carry the
out-of-range index L (gathered as NaN rows, dropped when scattered), so they change the work, not
the outputs. MAR-H at 64 iterations has 7 sizes; at batch 1, where a cached pass reads its
weights whatever its rows, one size runs as fast as four (0.99-1.01x) and halves the unrolled
compile (27-35 s against 60-70 on an H200 after MAR-H's in one process; 38-46 s alone, cold); at
batch 16 four are 1.11x faster (benchmarks/RESULTS.md). So `decoder_sizes='auto'` (the default) is 1
for a sampler called with one sample and 4 otherwise (the sampler binds the policy per batch,
`Binding.batch`).
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, ClassVar, Optional, Union

import jax
import jax.numpy as jnp

from accel.presets import Presets, setting_error
from var_models.mar.diffloss import HeadCache, HeadHooks
from var_models.mar.policy import IterInfo, IterPlan, MARPolicy, Site
from var_models.mar.schedule import merge_sizes
from var_models.nn import tokens as tok
from var_models.nn.blocks import BlockHooks
from var_models.nn.policy import Binding, Halves

Array = jax.Array

OFFICIAL_ITERS = 64
OFFICIAL_RATIOS = (1.0,) * 20 + (0.6,) + (0.5,) * 4 + (0.4,) * 5 + (0.15,) * 5 + (0.12,) * 5 + (0.05,) * 24
_OFF = dict(encoder=False, decoder=False, condition=False, head=False)

# name -> (settings, where they come from)
PRESETS = {
    'official': ({}, "the authors' code (models/mar_cache.py, basic.py, diffloss_cached.py), 64 iterations"),
    'scaled': (dict(scaled=True), "ours: the official constants mapped onto the sampler's iteration count "
                                  '(see the module docstring)'),
    'encoder_only': ({**_OFF, 'encoder': True}, 'ablation: the official encoder cache alone'),
    'decoder_only': ({**_OFF, 'decoder': True}, 'ablation: the official decoder token cache alone'),
    'condition_only': ({**_OFF, 'condition': True}, 'ablation: the official condition cache alone'),
    'head_only': ({**_OFF, 'head': True}, 'ablation: the official diffusion-head cache alone'),
    'off': (_OFF, 'every cache off: the baseline computation'),
}


def is_refresh(step: int, start: int, every: int) -> bool:
  """Whether iteration `step` is a full one."""
  return step < start or (step - start) % every == 0


def keep_count(length: int, ratio: float, n_now: int, n_prev: int, extra: int) -> int:
  """Decoder positions kept at a cached iteration: max(#now + #prev + extra, int(L * ratio)), at most L."""
  return min(length, max(n_now + n_prev + extra, int(length * ratio)))


def similarity_scores(v_now: Array, v_prev: Array, zero: Array, eps: float = 1e-8) -> Array:
  """Mean over heads of cos(v_now, v_prev) [B, L] from v [B, L, H, D] (float32), 0 where zero [B, L]."""
  a, b = v_now.astype(jnp.float32), v_prev.astype(jnp.float32)
  na = jnp.maximum(jnp.linalg.norm(a, axis=-1), eps)
  nb = jnp.maximum(jnp.linalg.norm(b, axis=-1), eps)
  cos = jnp.sum((a / na[..., None]) * (b / nb[..., None]), axis=-1)
  return jnp.where(zero, 0.0, jnp.mean(cos, axis=-1))


def kept_positions(scores: Array, count: Array, bound: int) -> Array:
  """The `count` (traced, <= bound) lowest scores of [B, L] (stable: ties keep the lower position)
  as ascending positions [B, bound], padded with L."""
  length = scores.shape[1]
  order = jnp.argsort(scores, axis=1, stable=True)[:, :bound]
  return jnp.sort(jnp.where(jnp.arange(bound) < count, order, length), axis=1).astype(jnp.int32)


def _positions_mask(idx: Array, length: int) -> Array:
  """idx [B, k] (padded with `length`) -> [B, length] bool."""
  return jnp.zeros((idx.shape[0], length), bool).at[jnp.arange(idx.shape[0])[:, None], idx].set(True)


@dataclasses.dataclass(frozen=True)
class _Bound:
  """What `bind` learns from the sampler."""
  length: int                  # buffer + N positions
  buffer: int
  max_pred: int
  refresh: tuple[bool, ...]    # per iteration
  keep: tuple[int, ...]        # per iteration: decoder positions kept (L at full iterations)
  bucket: tuple[int, ...]      # per iteration: the static (padded) kept count of its plan
  cfg: Any                     # the MARConfig
  scanned: bool                # K/V caches stacked on a layer axis (else one array per block)


@dataclasses.dataclass(frozen=True)
class _HeadCache(HeadCache):
  """The diffusion-head cache of one DiffLoss loop (see the module docstring); equal settings make
  equal caches, which the sampler compiles once."""
  interval: int
  warm: float
  skip: tuple[int, ...]
  dtype: Any

  def kinds(self, num_steps: int) -> tuple[str, ...]:
    def kind(i):
      if i == num_steps - 1 or i % self.interval == 0:
        return 'full'
      return 'recompute' if i > self.warm * num_steps else 'cached'
    return tuple(kind(num_steps - 1 - j) for j in range(num_steps))

  def init_state(self, rows: int, width: int, depth: int, channels: int) -> dict:
    """'mlp' and 'delta': one [rows, width] array per block (a step's write is the value its
    block computes, not an update of a stack), 'cfg' [rows, channels]."""
    zeros = (jnp.zeros((rows, width), self.dtype),) * depth
    return {'mlp': zeros, 'delta': zeros, 'cfg': jnp.zeros((rows, channels), jnp.float32)}

  def uncond(self, kind: str) -> bool:
    return kind == 'full'

  def hooks(self, kind: str) -> HeadHooks:
    return _HeadHooks(kind, self.skip)

  def guide(self, kind, eps_c, eps_u, guidance, state):
    if kind == 'full':
      state = {**state, 'cfg': eps_c - eps_u}
    else:
      eps_u = eps_c - state['cfg']
    return eps_u + guidance * (eps_c - eps_u), state


class _HeadHooks(HeadHooks):
  """One head step of `kind`; `replayed`: the blocks whose output - input a full step caches and
  the other steps add (the other blocks cache and reuse their MLP output)."""

  def __init__(self, kind: str, replayed: tuple[int, ...]):
    self.kind, self.replayed = kind, replayed
    self.skipped = () if kind == 'full' else replayed
    self.needs_mlp = kind != 'cached'   # a cached step reuses every MLP output: only gates are computed

  def skip(self, index, x, state):
    return x + state['delta'][index], state

  def res_block(self, index, x, gate, mlp, state):
    rows = state['mlp'][index].shape[0]
    if self.kind == 'cached':
      return x + gate * state['mlp'][index], state
    h = mlp()
    out = x + gate * h
    if index in self.replayed:
      return out, {**state, 'delta': _with_layer(state['delta'], index, (out - x)[:rows])}
    return out, {**state, 'mlp': _with_layer(state['mlp'], index, h[:rows])}


def _with_layer(cache, layer, value: Array):
  """A per-block cache (a tuple of one array per block, or one array stacked on a layer axis: the
  K/V caches, the head's MLP outputs and deltas) with layer `layer` replaced by value."""
  if isinstance(cache, tuple):
    return cache[:layer] + (value,) + cache[layer + 1:]
  return cache.at[layer].set(value)


def _cached_kv(state: dict, names: tuple[str, str], layer, idx: Array, k: Array, v: Array):
  """A cached iteration's K/V of one block: the fresh k, v [rows, k, H, D] of the forwarded
  positions idx [rows, k] written at layer `layer` of the caches state[names] -> (that layer's K,
  V [rows, L, H, D], state with the caches). Both write in place; a stacked cache's layer is then
  read out (a copy), a block's own array is read as it is."""
  caches = {}
  for n, a in zip(names, (k, v)):
    cache = state[n]
    if isinstance(cache, tuple):
      caches[n] = _with_layer(cache, layer, tok.scatter(cache[layer], idx, a))
    else:
      caches[n] = tok.scatter_layer(cache, layer, idx, a)
  return caches[names[0]][layer], caches[names[1]][layer], {**state, **caches}


class _EncoderHooks(BlockHooks):
  """Encoder block `block`: at a refresh store every position's K/V (the cached rows'); at a
  cached iteration forward the buffer and the previous predictions, attending through the cache."""

  def __init__(self, block, cached: bool):
    self.block, self.cached = block, cached

  def scan_group(self):
    return ('lazymar_encoder', self.cached)

  def for_layer(self, layer):
    return _EncoderHooks(layer, self.cached)

  def select(self, site, x, state):
    return (state['it']['enc_idx'] if self.cached else None), state

  def kv(self, k, v, idx, state):
    if not self.cached:
      rows = state['dec_in'].shape[0]
      return k, v, {**state, 'enc_k': _with_layer(state['enc_k'], self.block, k[:rows]),
                    'enc_v': _with_layer(state['enc_v'], self.block, v[:rows])}
    return _cached_kv(state, ('enc_k', 'enc_v'), self.block, idx, k, v)


class _DecoderHooks(BlockHooks):
  """Decoder block `block` >= the similarity block s (see the module docstring). bound None:
  a refresh, which stores block s's V and the later blocks' K/V; else a cached iteration
  keeping at most `bound` positions."""

  def __init__(self, policy: 'LazyMAR', block, bound: Optional[int]):
    self.policy, self.block, self.bound = policy, block, bound
    self.slot = block - policy.similarity_block - 1   # index into dec_k / dec_v (traced in a scan)
    self.similarity = isinstance(block, int) and block == policy.similarity_block

  def scan_group(self):
    return None if self.similarity else ('lazymar_decoder', self.bound)

  def for_layer(self, layer):
    return _DecoderHooks(self.policy, layer, self.bound)

  def select(self, site, x, state):
    if self.bound is None or (self.similarity and site == 'attn'):
      return None, state
    if not self.similarity:
      return state['it']['keep'], state
    it = state['it']
    scores = similarity_scores(it['v_now'], state['v_sim'], it['zero'])
    keep = kept_positions(scores, it['count'], self.bound)
    return keep, {**state, 'v_sim': it['v_now'], 'it': {**it, 'keep': keep}}

  def kv(self, k, v, idx, state):
    rows = state['v_sim'].shape[0]
    if self.similarity:
      if self.bound is None:
        return k, v, {**state, 'v_sim': v[:rows]}
      return k, v, {**state, 'it': {**state['it'], 'v_now': v}}
    if self.bound is not None:
      return _cached_kv(state, ('dec_k', 'dec_v'), self.slot, idx, k, v)
    return k, v, {**state, 'dec_k': _with_layer(state['dec_k'], self.slot, k[:rows]),
                  'dec_v': _with_layer(state['dec_v'], self.slot, v[:rows])}


@dataclasses.dataclass(frozen=True)
class LazyMAR(Presets, MARPolicy):
  """Static settings (see the module docstring):
    refresh_start, refresh_every -- the full iterations;
    ratios            -- per iteration, the decoder's kept fraction (one entry per iteration);
    encoder, decoder, condition, head -- which caches run;
    similarity_block  -- the decoder block whose V similarity selects the kept positions;
    extra_tokens      -- kept beyond this and the previous iteration's predictions;
    decoder_sizes     -- at most this many kept counts compiled (None: one per ratio; 'auto': 1 at batch 1,
                         else 4); outputs unchanged;
    head_interval, head_warm, head_skip -- the head cache's full steps, MLP warm-up, skipped blocks;
    scaled            -- map the 64-iteration constants onto the sampler's iteration count;
    source            -- where the setting comes from (presets say).
  The sampler binds it (`bind`), which checks the settings against the model and the schedule.
  """
  PRESETS: ClassVar[dict] = PRESETS
  refresh_start: int = 5
  refresh_every: int = 9
  ratios: tuple[float, ...] = OFFICIAL_RATIOS
  encoder: bool = True
  decoder: bool = True
  condition: bool = True
  head: bool = True
  similarity_block: int = 3
  extra_tokens: int = 15
  decoder_sizes: Union[int, str, None] = 'auto'
  head_interval: int = 7
  head_warm: float = 0.9
  head_skip: tuple[int, ...] = (1, 2, 3, 4)
  scaled: bool = False
  source: str = 'user'
  bound: Optional[_Bound] = dataclasses.field(default=None, repr=False, compare=False)  # set by bind

  def __post_init__(self):
    for name in ('refresh_start', 'refresh_every', 'head_interval'):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise setting_error(self, name, f'must be an int >= 1, got {getattr(self, name)!r}')
    sizes = self.decoder_sizes
    if sizes not in (None, 'auto') and (isinstance(sizes, bool) or not isinstance(sizes, int) or sizes < 1):
      raise setting_error(self, 'decoder_sizes', f"must be None, 'auto' or an int >= 1, got {sizes!r}")
    for name in ('similarity_block', 'extra_tokens'):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
        raise setting_error(self, name, f'must be an int >= 0, got {getattr(self, name)!r}')
    ratios = tuple(float(r) for r in self.ratios)
    if not ratios or not all(0.0 <= r <= 1.0 for r in ratios):
      raise setting_error(self, 'ratios', f'must be fractions in [0, 1], one per iteration, got {self.ratios}')
    object.__setattr__(self, 'ratios', ratios)
    if not 0.0 <= self.head_warm <= 1.0:
      raise setting_error(self, 'head_warm', f'must be in [0, 1], got {self.head_warm}')
    skip = tuple(sorted(int(i) for i in self.head_skip))
    if any(i < 0 for i in skip) or len(set(skip)) != len(skip):
      raise setting_error(self, 'head_skip', f'block indices must be distinct and >= 0, got {self.head_skip}')
    object.__setattr__(self, 'head_skip', skip)

  @property
  def caches_iterations(self) -> bool:
    """Whether cached iterations differ from full ones."""
    return self.encoder or self.decoder or self.condition

  def scaled_to(self, num_iter: int) -> 'LazyMAR':
    """The official 64-iteration constants mapped onto num_iter iterations (module docstring)."""
    ratios = tuple(OFFICIAL_RATIOS[k * OFFICIAL_ITERS // num_iter] for k in range(num_iter))
    return dataclasses.replace(self, refresh_start=math.ceil(5 * num_iter / OFFICIAL_ITERS),
                               refresh_every=max(1, round(9 * num_iter / OFFICIAL_ITERS)), ratios=ratios,
                               scaled=False)

  def bind(self, binding: Binding) -> 'LazyMAR':
    """The policy for `binding.model` (a MARConfig) and the mask schedule of `binding.schedule`
    (a MARSchedule), with its per-iteration counts in `bound`."""
    cfg, sched = binding.model, binding.schedule.mask
    num_iter = binding.schedule.num_iter
    if self.scaled:
      return self.scaled_to(num_iter).bind(binding)
    if not binding.guided:
      raise setting_error(self, 'guided', 'LazyMAR runs with CFG only (its caches hold both CFG halves): make '
                          'the sampler with guided=True')
    if len(self.ratios) != num_iter:
      raise setting_error(self, 'ratios', f'{len(self.ratios)} entries for a sampler of {num_iter} iterations (the '
                          "official constants fit 64; the 'scaled' preset fits any count)")
    if self.decoder and self.similarity_block >= cfg.decoder_depth:
      raise setting_error(self, 'similarity_block', f'block {self.similarity_block} is past the decoder depth '
                          f'{cfg.decoder_depth} (0-based)')
    if self.head and self.head_skip and self.head_skip[-1] >= cfg.diffloss_d:
      raise setting_error(self, 'head_skip',
                          f'block {self.head_skip[-1]} is past the head depth {cfg.diffloss_d} (0-based)')
    length = cfg.buffer_size + cfg.seq_len
    refresh = tuple(is_refresh(s, self.refresh_start, self.refresh_every) for s in range(num_iter))
    n_pred = [int(n) for n in sched.n_pred]
    keep = tuple(length if refresh[s] else
                 keep_count(length, self.ratios[s], n_pred[s], n_pred[s - 1], self.extra_tokens)
                 for s in range(num_iter))
    most = {}
    for s in range(num_iter):
      if not refresh[s]:
        most[self.ratios[s]] = max(most.get(self.ratios[s], 0), keep[s])
    cached = [most[self.ratios[s]] for s in range(num_iter) if not refresh[s]]
    sizes = self.decoder_sizes if self.decoder_sizes != 'auto' else (1 if binding.batch == 1 else 4)
    padded = merge_sizes(collections.Counter(cached), sizes)
    bucket = tuple(length if refresh[s] else padded[most[self.ratios[s]]] for s in range(num_iter))
    return dataclasses.replace(self, bound=_Bound(
        length=length, buffer=cfg.buffer_size, max_pred=sched.max_pred, refresh=refresh,
        keep=keep, bucket=bucket, cfg=cfg, scanned=binding.scanned))

  def _bound(self) -> _Bound:
    if self.bound is None:
      raise ValueError('LazyMAR: bind the policy first (make_mar_sampler does)')
    return self.bound

  def plan(self, num_iter: int) -> tuple[IterPlan, ...]:
    b = self._bound()
    if not self.caches_iterations:
      return (IterPlan(),) * num_iter
    return tuple(IterPlan(tag='full', every_position=self.encoder) if b.refresh[s] else
                 IterPlan(uncond=not self.condition, tag=('cached', b.bucket[s] if self.decoder else None),
                          every_position=self.encoder)
                 for s in range(num_iter))

  def init_state(self, batch: int) -> dict:
    """Caches of the rows cached iterations run (B with the condition cache, else 2B)."""
    b = self._bound()
    rows, state = self._rows(batch), {}
    state['prev_pred'] = jnp.full((batch, b.max_pred), b.length - b.buffer, jnp.int32)
    state['encoded'] = state['kept'] = jnp.ones((batch, b.length), bool)
    if self.encoder:
      state['enc_k'] = state['enc_v'] = self._kv_cache(rows, 'encoder')
      state['dec_in'] = jnp.zeros((rows, b.length, b.cfg.decoder_embed_dim), jnp.float32)   # the residual stream's
    if self.decoder:
      kv = self._kv_cache(rows, 'decoder')
      state['v_sim'] = kv[0]
      state['dec_k'] = state['dec_v'] = kv[self.similarity_block + 1:]
    if self.condition:
      state['diff'] = jnp.zeros((batch, b.length, b.cfg.decoder_embed_dim), jnp.float32)
    return state

  def _rows(self, batch: int) -> int:
    """Rows a cached iteration runs: the conditional half with the condition cache, else both."""
    return batch if self.condition else 2 * batch

  def _kv_cache(self, rows: int, part: str):
    """Zero K/V of every block of the encoder or decoder, [rows, L, heads, head dim] each: stacked
    on a layer axis for a scanned sampler (a block's index is traced there), else one array per
    block, which a cached iteration scatters into and attends over without copying it."""
    c, b = self._bound().cfg, self._bound()
    heads, depth, width = (getattr(c, f'{part}_{k}') for k in ('num_heads', 'depth', 'embed_dim'))
    zeros = jnp.zeros((depth, rows, b.length, heads, width // heads), c.dtype)
    return zeros if b.scanned else tuple(zeros)

  def begin(self, plan: IterPlan, info: IterInfo, state: dict) -> dict:
    b = self._bound()
    batch, cached = info.mask.shape[0], plan.tag not in (None, 'full')
    tile = lambda a: jnp.tile(a, (self._rows(batch) // batch, 1))
    offset = lambda idx: idx + b.buffer        # sequence positions -> buffer + sequence (N -> L: padding)
    buffer = jnp.broadcast_to(jnp.arange(b.buffer, dtype=jnp.int32), (batch, b.buffer))
    enc_idx = jnp.concatenate([buffer, offset(state['prev_pred'])], axis=1)
    known = jnp.concatenate([jnp.ones((batch, b.buffer), bool), ~info.mask], axis=1)
    it = {'pred': info.pred_idx, 'enc_idx': tile(enc_idx)}
    if cached and self.decoder:
      it['count'] = jnp.asarray(b.keep, jnp.int32)[info.step]
      both = jnp.concatenate([offset(info.pred_idx), offset(state['prev_pred'])], axis=1)
      it['zero'] = tile(_positions_mask(both, b.length))
    encoded = _positions_mask(enc_idx, b.length) if cached and self.encoder else known
    return {**state, 'it': it, 'encoded': encoded}

  def block_hooks(self, site: Site, depth: int):
    """The encoder cache's hooks on the encoder, the token cache's on the decoder (None where the
    cache is off or no iteration caches)."""
    plan = site.plan
    if plan.tag is None:
      return None
    if site.stack == 'encoder':
      return [_EncoderHooks(i, plan.tag != 'full') for i in range(depth)] if self.encoder else None
    if not self.decoder:
      return None
    bound = None if plan.tag == 'full' else plan.tag[1]
    s = self.similarity_block
    return [None] * s + [_DecoderHooks(self, i, bound) for i in range(s, depth)]

  def decoder_input(self, plan: IterPlan, x: Array, state: dict):
    if not self.encoder or plan.tag is None:
      return x, state
    rows = state['dec_in'].shape[0]
    if plan.tag != 'full':
      fresh = _positions_mask(state['it']['enc_idx'], self._bound().length)
      x = jnp.where(fresh[..., None], x, state['dec_in'].astype(x.dtype))
    return x, {**state, 'dec_in': x[:rows].astype(jnp.float32)}

  def guide(self, site: IterPlan, halves: Halves, state: dict):
    """The decoder blocks' output of the cond and uncond halves [B, L, Cd]: positions the decoder
    did not keep are 0; with the condition cache a cached iteration's uncond is cond + the last
    refresh's uncond - cond."""
    b, it, plan = self._bound(), state['it'], site
    cond, uncond = halves.both() if plan.uncond else (halves.cond(), None)
    batch, kept = cond.shape[0], state['kept']
    if 'keep' in it:
      kept_rows = _positions_mask(it['keep'], b.length)   # [rows, L]: each row's own kept positions
      cond = jnp.where(kept_rows[:batch, :, None], cond, jnp.zeros((), cond.dtype))
      if uncond is not None:
        uncond = jnp.where(kept_rows[batch:, :, None], uncond, jnp.zeros((), uncond.dtype))
      kept = kept_rows[:batch]
    elif plan.tag is not None:
      kept = jnp.ones_like(kept)
    if uncond is None:
      uncond = (cond + state['diff']).astype(cond.dtype)
    elif self.condition and plan.tag is not None:
      state = {**state, 'diff': (uncond - cond).astype(jnp.float32)}
    return (cond, uncond), {**state, 'kept': kept}

  def end(self, plan: IterPlan, state: dict) -> dict:
    """Notes the iteration's predicted positions for the next one and drops its scratch values."""
    rest = {k: v for k, v in state.items() if k != 'it'}
    return {**rest, 'prev_pred': state['it']['pred']}

  def head_cache(self, plan: IterPlan) -> Optional[HeadCache]:
    if not self.head:
      return None
    return _HeadCache(self.head_interval, self.head_warm, self.head_skip, self._bound().cfg.dtype)

  def record(self, plan: IterPlan, state: dict) -> dict:
    """'refresh' [] bool; 'encoded' [B, L]: the positions the encoder forwarded (buffer + known at
    a full iteration); 'kept' [B, L]: the decoder positions forwarded past the similarity block."""
    return {'refresh': jnp.asarray(plan.tag in (None, 'full')), 'encoded': state['encoded'], 'kept': state['kept']}
