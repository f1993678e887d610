"""Transformer building blocks shared by the next-scale models.

`AdaLNSelfAttn` is VAR's block. Its two residual branches go through
`_residual`, the hook point where a sampling policy may forward only a subset
of tokens and restore the rest (FastVAR); with no hooks it is the plain block.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels as pk
from var_models.nn import attention as attn_lib
from var_models.nn import tokens as tok

Array = jax.Array


def trunc_normal(std: float, bound: float = 2.0) -> Callable:
  """torch.nn.init.trunc_normal_(std=std): normal truncated at +-`bound` absolute."""
  def init(key, shape, dtype=jnp.float32):
    return std * jax.random.truncated_normal(key, -bound / std, bound / std, shape, dtype)
  return init


def scaled(init: Callable, factor: float) -> Callable:
  def scaled_init(key, shape, dtype=jnp.float32):
    return init(key, shape, dtype) * factor
  return scaled_init


def l2_normalize(x: Array, eps: float = 1e-12) -> Array:
  """torch.nn.functional.normalize(x, dim=-1), computed in float32.

  x * rsqrt(max(|x|^2, eps^2)) with the inverse norms behind an optimization
  barrier: without it XLA on GPU fuses the reduction and the rescale into one
  Triton normalization kernel that is slow on rows of 64 (RESULTS.md, VAR d30).
  """
  x32 = x.astype(jnp.float32)
  inv = lax.rsqrt(jnp.maximum(jnp.sum(x32 * x32, axis=-1, keepdims=True), eps * eps))
  return x32 * lax.optimization_barrier(inv)


def drop_path(x: Array, rate: float, deterministic: bool, module: nn.Module) -> Array:
  """Stochastic depth per sample, scaled by 1/keep (timm)."""
  if deterministic or rate == 0.0:
    return x
  keep = 1.0 - rate
  mask = jax.random.bernoulli(module.make_rng('dropout'), keep, (x.shape[0],) + (1,) * (x.ndim - 1))
  return jnp.where(mask, x / keep, 0).astype(x.dtype)


class SelfAttention(nn.Module):
  """VAR attention: qkv without bias plus learned q and v biases, optional L2-normalised
  q/k with a learned per-head temperature. x [B, l, C] -> [B, l, C]."""
  width: int
  num_heads: int
  attn_l2_norm: bool
  proj_init: Callable
  dense_init: Callable
  dropout: float = 0.0
  backend: str = 'xla'
  dtype: Any = jnp.float32

  def setup(self):
    c = self.width
    self.mat_qkv = nn.Dense(3 * c, use_bias=False, kernel_init=self.dense_init, dtype=self.dtype)
    self.q_bias = self.param('q_bias', nn.initializers.zeros, (c,))
    self.v_bias = self.param('v_bias', nn.initializers.zeros, (c,))
    if self.attn_l2_norm:
      self.scale_mul = self.param('scale_mul', nn.initializers.constant(math.log(4.0)), (self.num_heads,))
    self.proj = nn.Dense(c, kernel_init=self.proj_init, dtype=self.dtype)
    self.drop = nn.Dropout(self.dropout)

  def __call__(self, x: Array, *, mask: attn_lib.Mask = None, kv: Optional[attn_lib.KVCache] = None,
               hooks: Optional['BlockHooks'] = None, state: Any = None, deterministic: bool = True):
    """Returns (out [B, l, C], kv, state); with a cache, this call's k and v are appended
    first; with hooks, `hooks.attend` computes the attention (carrying `state`)."""
    b, l, c = x.shape
    h, d = self.num_heads, c // self.num_heads
    bias = jnp.concatenate([self.q_bias, jnp.zeros_like(self.q_bias), self.v_bias]).astype(self.dtype)
    q, k, v = jnp.split((self.mat_qkv(x) + bias).reshape(b, l, 3 * h, d), 3, axis=2)
    if self.attn_l2_norm:
      temp = jnp.exp(jnp.minimum(self.scale_mul, math.log(100.0)))[:, None]
      q = (l2_normalize(q) * temp).astype(self.dtype)
      k = l2_normalize(k).astype(self.dtype)
      scale = 1.0
    else:
      scale = 0.25 / math.sqrt(d)
    kv_len = None
    if kv is not None:
      k, v, kv_len, kv = kv.attend(k, v, mask)
    if hooks is None:
      out = attn_lib.attention(q, k, v, mask=mask, scale=scale, backend=self.backend, kv_len=kv_len)
    else:
      out, state = hooks.attend(q, k, v, mask=mask, kv_len=kv_len, scale=scale, backend=self.backend,
                                state=state)
    return self.drop(self.proj(out.reshape(b, l, c)), deterministic=deterministic), kv, state


class DenseGELU(nn.Module):
  """tanh-approximate GELU of an nn.Dense (same parameters, same value). [..., K] -> [..., N].

  `fused`: let `pallas_kernels.dense_gelu` pick its Hopper kernel, which never writes
  the pre-activation; training passes False, as the kernel's backward would recompute it.
  """
  features: int
  kernel_init: Callable
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, fused: bool) -> Array:
    kernel = self.param('kernel', self.kernel_init, (x.shape[-1], self.features))
    bias = self.param('bias', nn.initializers.zeros_init(), (self.features,))
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    return pk.dense_gelu(x, kernel, bias, impl='auto' if fused else 'reference')


class FFN(nn.Module):
  """fc1 -> tanh-approximate GELU -> fc2. [B, l, C] -> [B, l, C]."""
  width: int
  hidden: int
  proj_init: Callable
  dense_init: Callable
  dropout: float = 0.0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True, project: bool = True) -> Array:
    """project=False: (fc2's product without its bias, the bias), for a caller that fuses the bias
    with what follows (`unbiased`)."""
    x = DenseGELU(self.hidden, self.dense_init, self.dtype, name='fc1')(x, fused=deterministic)
    fc2 = nn.Dense(self.width, kernel_init=self.proj_init, dtype=self.dtype, name='fc2')
    if not project:
      return unbiased(fc2, x)
    return nn.Dropout(self.dropout)(fc2(x), deterministic=deterministic)


def unbiased(dense: nn.Dense, x: Array) -> tuple[Array, Array]:
  """A bound nn.Dense's product x @ kernel [..., N] and its bias [N] apart, in the Dense's dtype
  (their sum is the Dense's output): for a kernel that adds the bias with what follows it."""
  p = dense.variables['params']
  x, kernel, bias = nn.dtypes.promote_dtype(x, p['kernel'], p['bias'], dtype=dense.dtype)
  return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))), bias


def residual(module: nn.Module, x: Array, branch: Callable, site: str, hooks: Optional['BlockHooks'],
             state: Any, drop_path_rate: float, deterministic: bool):
  """x + branch(...) through the policy hook point of a block's sub-layer `site`.

  `branch(h, idx, state) -> (y, aux, state)` runs the sub-layer (norm included) on
  the tokens h it is given, idx [B, k] their positions in x (None: all of x), and
  may carry the policy's `state` (an attention sub-layer hands it to `hooks.kv`).
  With hooks, only the tokens `hooks.select` picks are forwarded and
  `hooks.restore` fills in the others. With `BlockHooks.restore`'s zeros, only the forwarded
  tokens change: x comes back as `tok.Rows` (their new values beside the stream), and the next
  sub-layer that forwards the same idx (the same array) takes those rows as they are; a stack
  of blocks ends with `tok.dense`. x: [B, N, C] or `tok.Rows`. Returns (x, aux, state).
  """
  dense = tok.dense(x)   # traced once; XLA drops it where only kept rows are read
  if hooks is None:
    y, aux, state = branch(dense, None, state)
    return dense + drop_path(y, drop_path_rate, deterministic, module), aux, state
  idx, state = hooks.select(site, dense, state)
  if idx is not None and type(hooks).restore is BlockHooks.restore:
    if not (isinstance(x, tok.Rows) and x.idx is idx):
      x = tok.Rows(dense, idx, tok.gather(dense, idx))
    y, aux, state = branch(x.rows, idx, state)
    y = drop_path(y, drop_path_rate, deterministic, module)
    dtype = jnp.result_type(x.rows, y)
    return tok.Rows(x.stale.astype(dtype), idx, x.rows.astype(dtype) + y.astype(dtype)), aux, state
  y, aux, state = branch(dense if idx is None else tok.gather(dense, idx), idx, state)
  y, state = hooks.restore(site, y, idx, dense, state)
  return dense + drop_path(y, drop_path_rate, deterministic, module), aux, state


def concat_dense(layers) -> tuple[Array, Array]:
  """Params {'kernel', 'bias'} of Dense layers that read one input -> one Dense: (kernel [in, sum
  of their outputs], bias). Built once outside a sampling loop, e.g. for every adaLN Linear of a
  denoiser (all read SiLU of the same condition): one GEMM per step replaces one per layer, and
  XLA does not re-concatenate the weights at every step when it merges those GEMMs itself."""
  return jnp.concatenate([l['kernel'] for l in layers], axis=1), jnp.concatenate([l['bias'] for l in layers])


def merged_dense(y: Array, merged: tuple[Array, Array], dtype) -> Array:
  """SiLU(y) [..., C] through `concat_dense`'s layers -> their outputs side by side [..., sum]."""
  kernel, bias = merged
  return jnp.dot(nn.silu(y).astype(dtype), kernel.astype(dtype)) + bias.astype(dtype)


# Rows up to which a sampling loop computes every step's adaLN outputs before it starts (MAR's
# diffusion head, E-CAR's flow denoisers). A GEMM on r rows does about r FLOPs per weight byte, so
# below a GPU's ridge point (~150 FLOP/B on an A100, ~200-300 on an H100 / H200, bf16) the per-step
# adaLN GEMM is a pass over its weights, the largest share of a denoiser's bytes, and one GEMM of
# every step's rows reads them once. The outputs of all steps (steps x rows x the merged width) are
# ~1.5 GB at 128 rows for MAR-H's head and E-CAR-L's last stage. Read when a sampler is traced.
ADALN_AHEAD_MAX_ROWS = 128


# XLA's options for the samplers whose GEMMs run on few rows or on a loop's slices of stacked weights
# (E-CAR's samplers, VAR's scanned ones): cuBLAS for every GEMM, none autotuned as a Triton fusion.
# They compile in about half the time and run as fast or faster (benchmarks/RESULTS.md, "Issue 39's
# targets" and "E-CAR's samplers on cuBLAS"); other backends ignore them. MAR's sampler keeps XLA's
# defaults (without Triton's GEMMs it runs 1.3-1.4x slower), and so do the train steps (1 % slower).
CUBLAS_GEMMS = {'xla_gpu_enable_triton_gemm': False}


def adaln_ahead_pays(rows: int) -> bool:
  """Whether a loop whose denoiser calls run on `rows` rows computes its adaLN outputs ahead."""
  return rows <= ADALN_AHEAD_MAX_ROWS


def split_modulations(out: Array, width: int, count: int) -> list[Array]:
  """`merged_dense`'s output [..., sum] -> its layers' outputs: `count` of `width` each, then the
  last layer's."""
  return jnp.split(out, np.cumsum([width] * count), axis=-1)


def merged_modulations(y: Array, merged: tuple[Array, Array], width: int, count: int, dtype) -> list[Array]:
  """SiLU(y) [..., C] through `concat_dense`'s layers -> their outputs (`split_modulations`)."""
  return split_modulations(merged_dense(y, merged, dtype), width, count)


def dense_params_in(params, dtype) -> dict:
  """params with every Dense layer's kernel and bias in `dtype` (what a Dense of that compute
  dtype casts them to at each call anyway); LayerNorm params stay. Samplers cast once, outside
  their loops: XLA does not hoist size-changing converts out of a while loop, so inside it
  every diffusion or flow step would re-convert every weight."""
  if 'kernel' in params:
    return {k: v.astype(dtype) for k, v in params.items()}
  return {k: dense_params_in(v, dtype) if isinstance(v, dict) else v for k, v in params.items()}


def layer_norm(eps: float, dtype) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=eps, use_scale=False, use_bias=False, dtype=dtype)


def modulate(x: Array, scale: Array, shift: Array) -> Array:
  """AdaLN modulation x * (1 + scale) + shift; scale and shift broadcast against x [..., C]."""
  return x * (1 + scale) + shift


class AdaLNSelfAttn(nn.Module):
  """VAR's AdaLN block. x [B, l, C], cond [B, D] (or [B, 6, C] with shared AdaLN).

  The six modulation vectors come, in this order, as gamma1, gamma2, scale1,
  scale2, shift1, shift2 (the official chunk order, which the converter relies on).
  """
  width: int
  num_heads: int
  mlp_ratio: float
  norm_eps: float
  attn_l2_norm: bool
  shared_aln: bool
  drop_path_rate: float
  dense_init: Callable
  proj_init: Callable
  ada_init: Callable
  dropout: float = 0.0
  backend: str = 'xla'
  dtype: Any = jnp.float32

  def setup(self):
    c = self.width
    self.attn = SelfAttention(c, self.num_heads, self.attn_l2_norm, self.proj_init, self.dense_init,
                              self.dropout, self.backend, self.dtype)
    self.ffn = FFN(c, round(c * self.mlp_ratio), self.proj_init, self.dense_init, self.dropout, self.dtype)
    self.ln = layer_norm(self.norm_eps, self.dtype)
    if self.shared_aln:
      self.ada_gss = self.param('ada_gss', self.ada_init, (6, c))
    else:
      self.ada_lin = nn.Dense(6 * c, kernel_init=self.ada_init, dtype=self.dtype)

  def modulation(self, cond: Array) -> Array:
    """[B, 6, C]: gamma1, gamma2, scale1, scale2, shift1, shift2, from the block condition
    (cond [B, D], or the shared [B, 6, C]). Constant over a sample's scales, so samplers
    compute it once."""
    if self.shared_aln:
      return (self.ada_gss + cond).astype(self.dtype)
    return self.ada_lin(nn.silu(cond)).reshape(cond.shape[0], 6, self.width)

  def __call__(self, x: Array, mod: Array, *, mask: attn_lib.Mask = None,
               kv: Optional[attn_lib.KVCache] = None, hooks: Optional['BlockHooks'] = None,
               state: Any = None, deterministic: bool = True):
    """x [B, l, C], mod [B, 6, C] from `modulation`. Returns (x, kv, state).

    `hooks` (from a sampling policy) may select tokens before each branch and
    restore the others after it, carrying `state`.
    """
    g1, g2, s1, s2, b1, b2 = [m[:, None] for m in jnp.moveaxis(mod.astype(self.dtype), 1, 0)]

    def attn_branch(h, idx, state):
      out, new_kv, state = self.attn(modulate(self.ln(h), s1, b1), mask=mask, kv=kv, hooks=hooks,
                                     state=state, deterministic=deterministic)
      return out * g1, new_kv, state

    def ffn_branch(h, idx, state):
      return self.ffn(modulate(self.ln(h), s2, b2), deterministic) * g2, None, state

    x, new_kv, state = residual(self, x, attn_branch, 'attn', hooks, state, self.drop_path_rate, deterministic)
    x, _, state = residual(self, x, ffn_branch, 'ffn', hooks, state, self.drop_path_rate, deterministic)
    return x, new_kv, state


class AdaLNBeforeHead(nn.Module):
  """LayerNorm modulated by SiLU -> Linear(D, 2C) of the condition (scale, shift)."""
  width: int
  norm_eps: float
  ada_init: Callable
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, cond: Array) -> Array:
    ss = nn.Dense(2 * self.width, kernel_init=self.ada_init, dtype=self.dtype, name='ada_lin')(nn.silu(cond))
    scale, shift = ss.reshape(cond.shape[0], 2, self.width)[:, :, None].swapaxes(0, 1)
    return modulate(layer_norm(self.norm_eps, self.dtype)(x), scale, shift)


class BlockHooks:
  """Per-block policy hooks (see var_models.var.policy). The base forwards everything."""

  def select(self, site: str, x: Array, state: Any):
    """Indices [B, k] of the tokens of x [B, l, C] to forward before `site`, or None."""
    return None, state

  def selects(self, site: str) -> bool:
    """Whether `select` returns indices at `site` (static). `accel.compose` asks it to know whose
    `restore` fills in the tokens not forwarded, so a composable hook that selects says it here."""
    return False

  def kv(self, k: Array, v: Array, idx: Optional[Array], state: Any):
    """The keys and values [B, Lk, H, D] the forwarded queries attend to, from those of the
    forwarded tokens k, v [B, k, H, D] (idx [B, k] their positions, None for all): e.g. a
    policy's cached K/V of every position with the fresh ones written at idx. The
    attention mask applies to what this returns."""
    return k, v, state

  def attend(self, q: Array, k: Array, v: Array, *, mask: attn_lib.Mask, kv_len: Optional[int],
             scale: float, backend: str, state: Any):
    """The attention of the forwarded queries q [B, l, H, D] over k, v [B, Lk, H, D] (the first
    kv_len valid; None: all) under `mask` -> (out [B, l, H, D], state): e.g. a sparse pattern
    (SparVAR). Called by VAR's attention (`SelfAttention`)."""
    return attn_lib.attention(q, k, v, mask=mask, scale=scale, backend=backend, kv_len=kv_len), state

  def restore(self, site: str, y: Array, idx: Optional[Array], x: Array, state: Any):
    """The branch output for all l tokens from y [B, k, C] of the forwarded ones; this default's
    is 0 for the others (`residual` adds y at idx itself where the hooks keep this default)."""
    if idx is None:
      return y, state
    return tok.scatter(jnp.zeros_like(x, dtype=y.dtype), idx, y), state

  def scan_group(self) -> Optional[Hashable]:
    """A key (static, hashable), or None. Consecutive blocks whose hooks give one key compute alike
    but for their `layer_state` and their layer: a sampler may run them as one scan, the first
    block's hooks `for_layer` standing for each. None: the block runs alone."""
    return None

  def for_layer(self, layer: Array) -> 'BlockHooks':
    """These hooks (of a scan group's first block) as block `layer`'s (an int32 scalar, traced
    inside a scan); hooks that do not depend on their block return themselves."""
    return self

  def layer_state(self) -> tuple[str, ...]:
    """The keys of `state` this block alone reads or writes (in one order across a scan group:
    a scan stacks them on a layer axis). Every other key a hook adds must exist before."""
    return ()
