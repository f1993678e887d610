"""The one attention entry point of every model, and its KV cache.

Models call `attention(q, k, v, mask=..., backend=...)` (a cache-free self-attention
`attention(qkv, ...)` with its projection's packed output); the backend is a
config string, so kernels plug in (`register_backend`) without touching a model.
Masks are descriptions, not dense arrays, so a backend can exploit structure:
  None                  -- every query sees every key;
  ScaleCausal(lq, lk)   -- query i sees key j iff level(i) >= level(j): causal
                           across scales, bidirectional inside one;
  TokenMask(mask)       -- an explicit boolean mask broadcastable to [B, H, Lq, Lk];
  BlockSparse(layout)   -- a static tile layout (pallas_kernels.BlockLayout, e.g.
                           SparVAR's CSLA) over the first layout.lk keys;
  GatheredKeys(idx, g)  -- query group i (queries [i g, (i + 1) g)) sees only the
                           keys idx[b, h, i, :], a traced list (SparVAR's CS4A).
The two sparse masks are the kernels' to compute whatever the backend (a dense
backend would compute every tile and skip nothing): they go to pallas_kernels
with impl 'auto', the Triton kernels on a GPU and their plain-jnp references
elsewhere. Both read a KV cache's buffer in place, keys past kv_len unseen.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class ScaleCausal:
  """Per-token scale levels of the queries [Lq] and keys [Lk] (static NumPy)."""
  q_levels: np.ndarray
  k_levels: np.ndarray

  def dense(self) -> np.ndarray:
    """[1, 1, Lq, Lk] bool."""
    return (np.asarray(self.q_levels)[:, None] >= np.asarray(self.k_levels)[None, :])[None, None]


@dataclasses.dataclass(frozen=True, eq=False)
class TokenMask:
  """Boolean mask (True = attend) broadcastable to [B, H, Lq, Lk]."""
  mask: Union[jax.Array, np.ndarray]

  def dense(self):
    return self.mask


@dataclasses.dataclass(frozen=True, eq=False)
class BlockSparse:
  """A static pallas_kernels.BlockLayout: its queries see the keys of its tiles among the
  first layout.lk."""
  layout: Any

  def dense(self) -> np.ndarray:
    """[1, Hl, Lq, Lk] bool."""
    return self.layout.dense()[None]


@dataclasses.dataclass(frozen=True, eq=False)
class GatheredKeys:
  """Query group i (queries [i * group, (i + 1) * group)) sees only the keys idx[b, h, i, :]:
  idx [B, H, ceil(Lq / group), n] int (traced); entries outside [0, kv_len) are padding and a
  key listed twice counts twice (callers deduplicate)."""
  idx: jax.Array
  group: int


SPARSE = (BlockSparse, GatheredKeys)
Mask = Optional[Union[ScaleCausal, TokenMask, BlockSparse, GatheredKeys]]
Backend = Callable[..., jax.Array]


def _check(q, k, v, mask) -> None:
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f'attention expects [B, L, H, D] q, k, v; got {q.shape}, {k.shape}, {v.shape}')
  if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
    raise ValueError(f'attention shapes disagree: q {q.shape}, k {k.shape}, v {v.shape}')
  if isinstance(mask, ScaleCausal):
    if (len(mask.q_levels), len(mask.k_levels)) != (q.shape[1], k.shape[1]):
      raise ValueError(f'ScaleCausal levels ({len(mask.q_levels)}, {len(mask.k_levels)}) do not '
                       f'match Lq={q.shape[1]}, Lk={k.shape[1]}')
  if isinstance(mask, BlockSparse) and (q.shape[1] != mask.layout.lq or k.shape[1] < mask.layout.lk):
    raise ValueError(f'BlockSparse layout is for Lq={mask.layout.lq} over {mask.layout.lk} keys; got '
                     f'Lq={q.shape[1]}, Lk={k.shape[1]}')


def _cudnn_takes(q: jax.Array) -> bool:
  """Whether cuDNN's flash attention takes q's dtype and head dim."""
  d = q.shape[-1]
  return q.dtype in (jnp.bfloat16, jnp.float16) and d <= 256 and d % 8 == 0


def _dense_backend(implementation: Optional[str]) -> Backend:
  """jax.nn.dot_product_attention; 'cudnn' hands what cuDNN refuses (float32, head
  dims over 256 such as a VAE's one-head mid attention) to 'xla'."""
  def run(q, k, v, mask: Mask, scale: float, kv_len: Optional[int]):
    if implementation == 'cudnn' and not _cudnn_takes(q):
      return _BACKENDS['xla'](q, k, v, mask, scale, kv_len)
    dense = None if mask is None else jnp.asarray(mask.dense())
    if dense is not None and implementation == 'cudnn':
      # cuDNN takes a mask only with both sequence axes full (e.g. not a [B, 1, 1, Lk] key mask).
      dense = jnp.broadcast_to(dense, dense.shape[:2] + (q.shape[1], k.shape[1]))
    lengths = None if kv_len is None else jnp.full((q.shape[0],), kv_len, jnp.int32)
    return jax.nn.dot_product_attention(
        q, k, v, mask=dense, scale=scale, key_value_seq_lengths=lengths,
        implementation=implementation)
  return run


def _sparse(q, k, v, mask: Mask, scale: float, kv_len: Optional[int]):
  """A BlockSparse or GatheredKeys mask through pallas_kernels (see the module docstring)."""
  import pallas_kernels as pk
  if isinstance(mask, GatheredKeys):
    return pk.gathered_attention(q, k, v, mask.idx, group=mask.group, scale=scale, kv_len=kv_len)
  layout = mask.layout
  if kv_len is not None and kv_len != layout.lk:
    raise ValueError(f'BlockSparse layout over {layout.lk} keys, but kv_len={kv_len}')
  # The kernel reads at most the layout's key blocks of a longer buffer.
  end = min(k.shape[1], layout.num_k_blocks * layout.block_k)
  return pk.block_sparse_attention(q, k[:, :end], v[:, :end], layout, scale=scale)


def _key_mask(q, k, mask: Mask):
  """A TokenMask broadcast over heads and queries ([B | 1, 1, 1, Lk]) as `few_token_attention`'s
  key_mask [B, Lk] bool; None for any other mask."""
  if not isinstance(mask, TokenMask):
    return None
  m = mask.mask
  if m.ndim != 4 or m.shape[1:] != (1, 1, k.shape[1]) or m.shape[0] not in (1, q.shape[0]):
    return None
  return jnp.broadcast_to(jnp.asarray(m)[:, 0, 0], (q.shape[0], k.shape[1]))


def _few_token_call(q, k, v, mask: Mask, kv_len: Optional[int]) -> bool:
  """Whether `few_token_attention` takes the call: unmasked or under a key mask (`_key_mask`), and
  of the lengths (kv_len's keys where given), head dim and dtype it holds."""
  import pallas_kernels as pk
  if mask is not None and _key_mask(q, k, mask) is None:
    return False
  return not pk.few_token_attention_unsupported(q, k, v, kv_len)


def _few_token_operands(q, k, v, packed: Optional[jax.Array]) -> tuple:
  """What `few_token_attention` reads: the packed qkv q, k and v were cut from (read in place),
  else q, k and v."""
  return (q, k, v) if packed is None else (packed,)


def _pallas_backend(q, k, v, mask: Mask, scale: float, kv_len: Optional[int], packed: Optional[jax.Array] = None):
  """pallas_kernels' attention: unmasked or under a key mask over at most `few_token_attention`'s
  MAX_TOKENS queries and keys (of a kv_len's), that kernel (reading `packed` in place where given,
  MAR's 80-wide heads and its encoder's key mask included); else the
  block-sparse kernel, which skips the tiles a ScaleCausal mask or a kv_len excludes. Other
  TokenMasks (possibly traced, per batch) and head dims or dtypes the kernels do not take go to
  xla."""
  import pallas_kernels as pk
  if _few_token_call(q, k, v, mask, kv_len):
    return pk.few_token_attention(*_few_token_operands(q, k, v, packed), scale=scale, kv_len=kv_len,
                                  key_mask=_key_mask(q, k, mask))
  d = q.shape[-1]
  if (isinstance(mask, TokenMask) or d < 16 or d > pk.MAX_HEAD_DIM or d & (d - 1)
      or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16)):
    return _BACKENDS['xla'](q, k, v, mask, scale, kv_len)
  bq, bk = pk.default_block(q.shape[1]), pk.default_block(k.shape[1])
  if isinstance(mask, ScaleCausal):
    layout = pk.level_causal_layout(mask.q_levels, mask.k_levels, bq, bk)
  else:
    layout = pk.dense_layout(q.shape[1], k.shape[1], bq, bk, kv_len)
  return pk.block_sparse_attention(q, k, v, layout, scale=scale)


def _undifferentiated(fast: Callable, differentiable: Callable) -> Callable:
  """(*arrays) -> `fast`'s output where the call is not differentiated, and `differentiable`'s
  forward and backward where it is (JAX calls a custom VJP's forward rule only under
  differentiation)."""
  @jax.custom_vjp
  def run(*arrays):
    return fast(*arrays)

  run.defvjp(lambda *arrays: jax.vjp(differentiable, *arrays), lambda vjp, g: vjp(g))
  return run


# Queries of a call (B x Lq) up to which the `cudnn` backend runs `few_token_attention` on a call
# past one block without a KV cache: at MAR-H's batch 1 (1-2 x 71-320 queries over 320 keys) the
# kernel takes 0.6-0.9x cuDNN's time, at batch 16 (16-32 x 71-320) up to 1.9x, and LazyMAR's sampler
# there ran 1.4 % slower on it (benchmarks/RESULTS.md, "the few-token kernel at batch 16").
FEW_TOKEN_MAX_QUERIES = 1024


def _few_tokens_on_the_kernel(backend: Backend) -> Backend:
  """`backend`, except that a call `few_token_attention` takes (unmasked or under a key mask, at
  most its MAX_TOKENS queries and keys), in a dtype and head dim cuDNN takes, that is not
  differentiated (a sampler's) and either is one block of the kernel (at most `FEW_TOKENS`
  queries and keys, of a kv_len's) or reads no KV cache and holds at most `FEW_TOKEN_MAX_QUERIES`
  queries runs the kernel, where cuDNN's call adds a memset and ~5 us of launch gaps: E-CAR's
  denoisers over a stage's tokens (E-CAR-L samples 14 % faster), VAR's first scales over their KV
  cache, MAR's encoder and decoder over 320 tokens at batch 1 (MAR-H's LazyMAR sampler 1.5 % faster;
  benchmarks/RESULTS.md). VAR's later scales, past one block over a KV cache, keep cuDNN (not
  measured on the kernel). Differentiated, the call keeps `backend`'s forward and backward: on the
  kernel with XLA's backward E-CAR-B's train step was 2.3 % slower."""
  def run(q, k, v, mask: Mask, scale: float, kv_len: Optional[int], packed: Optional[jax.Array] = None):
    import pallas_kernels as pk
    dense = lambda q, k, v: backend(q, k, v, mask, scale, kv_len)
    one_block = max(q.shape[1], k.shape[1] if kv_len is None else kv_len) <= pk.FEW_TOKENS
    few_queries = kv_len is None and q.shape[0] * q.shape[1] <= FEW_TOKEN_MAX_QUERIES
    if not (_cudnn_takes(q) and (one_block or few_queries) and _few_token_call(q, k, v, mask, kv_len)):
      return dense(q, k, v)
    key_mask = _key_mask(q, k, mask)
    fast = lambda *operands: pk.few_token_attention(*operands, scale=scale, kv_len=kv_len, key_mask=key_mask)
    differentiable = dense if packed is None else lambda qkv: dense(*_unpacked(qkv))
    return _undifferentiated(fast, differentiable)(*_few_token_operands(q, k, v, packed))
  return run


_BACKENDS: dict[str, Backend] = {
    'xla': _dense_backend('xla'),
    'cudnn': _few_tokens_on_the_kernel(_dense_backend('cudnn')),
    'pallas': _pallas_backend,
}
# The backends that take `packed=` (a self-attention call's qkv [B, L, 3, H, D], q, k and v its
# slices), to read it in place where they run `few_token_attention`: a slice of it for each of
# q, k and v would be a copy kernel before every call.
_READS_PACKED = {'cudnn', 'pallas'}


def register_backend(name: str, fn: Backend, reads_packed: bool = False) -> None:
  """Adds a backend `fn(q, k, v, mask, scale, kv_len) -> out` under `name` (`reads_packed`: fn
  also takes `packed=`, see `_READS_PACKED`)."""
  _BACKENDS[name] = fn
  (_READS_PACKED.add if reads_packed else _READS_PACKED.discard)(name)


def _unpacked(qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """qkv [B, L, 3, H, D] -> q, k, v [B, L, H, D]."""
  return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def backends() -> tuple[str, ...]:
  return tuple(sorted(_BACKENDS))


def check_backend(name: str) -> None:
  if name not in _BACKENDS:
    raise ValueError(f'unknown attention backend {name!r}; known: {backends()}')


def _dropout_attention(q, k, v, mask: Mask, scale: float, rate: float, rng) -> jax.Array:
  """Explicit softmax attention with dropout on the probabilities (training of
  models trained so, e.g. MAR); the fused backends have no dropout."""
  logits = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32) * scale
  if mask is not None:
    logits = jnp.where(jnp.asarray(mask.dense()), logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
  probs = jnp.where(keep, probs / (1.0 - rate), 0.0).astype(v.dtype)
  return jnp.einsum('bhqk,bkhd->bqhd', probs, v)


def attention(q: jax.Array, k: Optional[jax.Array] = None, v: Optional[jax.Array] = None, *, mask: Mask = None,
              scale: Optional[float] = None, backend: str = 'xla',
              kv_len: Optional[int] = None, dropout_rate: float = 0.0,
              dropout_rng: Optional[jax.Array] = None) -> jax.Array:
  """Softmax attention. q [B, Lq, H, D], k and v [B, Lk, H, D] -> [B, Lq, H, D]; or, with k and v
  None, self-attention of a packed qkv [B, L, 3, H, D] (a fused qkv projection's output), which a
  backend may read in place (`_READS_PACKED`).

  `scale` multiplies q.k (default 1/sqrt(D)); softmax runs in float32.
  `kv_len` (static) uses only the first kv_len keys: a KV cache is read in
  place rather than copied out as a prefix. With `dropout_rng` and a positive
  `dropout_rate`, attention probabilities are dropped (any backend falls back
  to the explicit computation then).
  """
  check_backend(backend)
  packed = None
  if k is None or v is None:
    if k is not None or v is not None or q.ndim != 5 or q.shape[2] != 3 or kv_len is not None:
      raise ValueError(f'attention of a packed qkv takes [B, L, 3, H, D] and no kv_len, got {q.shape}, '
                       f'kv_len={kv_len}')
    packed, (q, k, v) = q, _unpacked(q)
  _check(q, k, v, mask)
  if kv_len is not None and not 0 < kv_len <= k.shape[1]:
    raise ValueError(f'kv_len must be in (0, {k.shape[1]}], got {kv_len}')
  if kv_len is not None and mask is not None and not isinstance(mask, SPARSE):
    raise ValueError('attention takes a dense mask or a kv_len, not both: slice the keys instead')
  if scale is None:
    scale = 1.0 / float(np.sqrt(q.shape[-1]))
  if kv_len == k.shape[1]:
    kv_len = None
  if isinstance(mask, SPARSE):
    if dropout_rng is not None and dropout_rate > 0:
      raise ValueError(f'{type(mask).__name__} attention has no dropout (sampling only)')
    return _sparse(q, k, v, mask, scale, kv_len)
  if dropout_rng is not None and dropout_rate > 0:
    if kv_len is not None:
      k, v = k[:, :kv_len], v[:, :kv_len]
    return _dropout_attention(q, k, v, mask, scale, dropout_rate, dropout_rng)
  if packed is not None and backend in _READS_PACKED:
    return _BACKENDS[backend](q, k, v, mask, scale, kv_len, packed=packed)
  return _BACKENDS[backend](q, k, v, mask, scale, kv_len)


def _zero_buffers(n: int, shape: tuple[int, ...], dtype) -> list[jax.Array]:
  """n zero-filled buffers of `shape`, each its own (KV caches, written in place later)."""
  # Each buffer is filled from its own zero, which the inner barrier hides from XLA: from one
  # zero constant, CSE would merge the n fills into one buffer and copy it into every cache (a
  # read and a write per byte). The outer barrier keeps XLA from folding a fill and the first
  # append into a pad kernel, which writes slower (RESULTS.md, VAR d30).
  zeros = jax.lax.optimization_barrier(jnp.zeros((n,), dtype))
  return jax.lax.optimization_barrier([jnp.broadcast_to(zeros[i], shape) for i in range(n)])


@flax.struct.dataclass
class KVCache:
  """Preallocated keys/values [B, capacity, H, D]; `length` is static.

  `append` writes at a static offset, so under jit every scale's attention reads
  a static prefix and the cache lives in one buffer across the scale loop.
  """
  k: jax.Array
  v: jax.Array
  length: int = flax.struct.field(pytree_node=False, default=0)

  @classmethod
  def create(cls, batch: int, capacity: int, heads: int, head_dim: int, dtype) -> 'KVCache':
    """One empty cache, zero-filled: k and v [batch, capacity, heads, head_dim]."""
    return cls.create_many(1, batch, capacity, heads, head_dim, dtype)[0]

  @classmethod
  def create_many(cls, n: int, batch: int, capacity: int, heads: int, head_dim: int,
                  dtype) -> list['KVCache']:
    """n empty caches (one per layer), each as `create` makes it."""
    bufs = _zero_buffers(2 * n, (batch, capacity, heads, head_dim), dtype)
    return [cls(bufs[2 * i], bufs[2 * i + 1], 0) for i in range(n)]

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def append(self, k: jax.Array, v: jax.Array) -> 'KVCache':
    """Appends k, v [B, l, H, D]; returns the new cache."""
    end = self.length + k.shape[1]
    if end > self.capacity:
      raise ValueError(f'KV cache overflow: {self.length} + {k.shape[1]} > capacity {self.capacity}')
    k_all = self.k.at[:, self.length:end].set(k.astype(self.k.dtype))
    v_all = self.v.at[:, self.length:end].set(v.astype(self.v.dtype))
    return KVCache(k_all, v_all, end)

  def attend(self, k: jax.Array, v: jax.Array, mask: 'Mask'):
    """Appends k, v and returns (keys, values, kv_len, new cache): what the new queries attend
    to. Unmasked or under a sparse mask, the buffer is read in place with its valid length
    `kv_len`; a dense mask needs the exact key set (kv_len None)."""
    kv = self.append(k, v)
    if mask is None or isinstance(mask, SPARSE):
      return kv.k, kv.v, kv.length, kv
    return kv.keys(), kv.values(), None, kv

  def keys(self) -> jax.Array:
    return self.k[:, :self.length]

  def values(self) -> jax.Array:
    return self.v[:, :self.length]


@flax.struct.dataclass
class LayerSlot:
  """Layer `layer`'s cache (an int, or a scan's traced index) in the stacked buffers k, v [depth, B,
  capacity, H, D] of `LayerKVCaches`, `length` (static) keys valid. `attend` writes the step's keys
  into the stack in place, then copies the layer's keys out [B, length + l, H, D], as the
  attention kernels take whole buffers: each new key written once, no key copied twice."""
  k: jax.Array
  v: jax.Array
  layer: Any
  length: int = flax.struct.field(pytree_node=False, default=0)

  def attend(self, k: jax.Array, v: jax.Array, mask: 'Mask'):
    """Appends k, v [B, l, H, D] -> (keys, values [B, length + l, H, D], None, the slot after)."""
    end = self.length + k.shape[1]
    if end > self.k.shape[2]:
      raise ValueError(f'KV cache overflow: {self.length} + {k.shape[1]} > capacity {self.k.shape[2]}')
    at = (self.layer, 0, self.length, 0, 0)
    k_all, v_all = (jax.lax.dynamic_update_slice(a, x[None].astype(a.dtype), at) for a, x in ((self.k, k), (self.v, v)))
    keys, values = (jax.lax.dynamic_index_in_dim(a, self.layer, 0, keepdims=False)[:, :end] for a in (k_all, v_all))
    return keys, values, None, LayerSlot(k_all, v_all, self.layer, end)


@flax.struct.dataclass
class LayerKVCaches:
  """The KV caches of `depth` layers as one buffer each: k, v [depth, B, capacity, H, D].

  `lengths` (static) holds each layer's valid length: layers whose policy forwarded fewer tokens
  hold fewer keys. Layer i's cache is `layer(i)` (i an int, or a scan's traced index with the
  static length of its run's layers), a `LayerSlot` that writes the layer's new keys into the
  buffers in place; `put(slot)` takes the buffers back, so they are never copied whole.
  """
  k: jax.Array
  v: jax.Array
  lengths: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

  @classmethod
  def create(cls, depth: int, batch: int, capacity: int, heads: int, head_dim: int, dtype) -> 'LayerKVCaches':
    """Empty caches, zero-filled: k and v [depth, batch, capacity, heads, head_dim]."""
    k, v = _zero_buffers(2, (depth, batch, capacity, heads, head_dim), dtype)
    return cls(k, v, (0,) * depth)

  def layer(self, i, length: Optional[int] = None) -> LayerSlot:
    """Layer i's cache: i an int (its length from `lengths`), or traced with its static `length`."""
    return LayerSlot(self.k, self.v, i, self.lengths[i] if length is None else length)

  def put(self, slot: LayerSlot) -> 'LayerKVCaches':
    """The buffers of `slot` (from `layer`, after its `attend`); `lengths` is unchanged
    (`with_lengths` sets them once every layer is written)."""
    return LayerKVCaches(slot.k, slot.v, self.lengths)

  def with_lengths(self, lengths: tuple[int, ...]) -> 'LayerKVCaches':
    return LayerKVCaches(self.k, self.v, tuple(lengths))
