"""The pre-LayerNorm ViT block with timm's `vision_transformer.Block` semantics.

x + Attn(LN(x)), then x + MLP(LN(x)); qkv packs (q, k, v) x heads x head_dim on
its output axis as timm does, the MLP uses exact (erf) GELU (`gelu_exact`: in float32,
as torch computes it on bfloat16 too), and dropout sits on the attention probabilities,
after the attention projection, after the MLP's activation and after fc2. Parameter names
mirror timm's (norm1, attn/qkv, attn/proj, norm2, mlp/fc1, mlp/fc2) so converters map keys
one to one. Both sub-layers go through `blocks.residual`, the policy hook point.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from var_models.nn import attention as attn_lib
from var_models.nn.blocks import BlockHooks, residual, unbiased

Array = jax.Array

xavier_uniform = nn.initializers.xavier_uniform()


def torch_layer_norm(eps: float, dtype: Any = None) -> nn.LayerNorm:
  """Affine LayerNorm with torch's two-pass variance: flax's default E[x^2] - E[x]^2 loses
  precision when a token's mean is large against its spread (deep residual streams)."""
  return nn.LayerNorm(epsilon=eps, use_fast_variance=False, dtype=dtype)


class Attention(nn.Module):
  """Multi-head self-attention. x [B, l, C] -> [B, l, C]."""
  width: int
  num_heads: int
  qkv_bias: bool = True
  attn_drop: float = 0.0
  proj_drop: float = 0.0
  kernel_init: Callable = xavier_uniform
  backend: str = 'xla'
  dtype: Any = jnp.float32

  def setup(self):
    self.qkv = nn.Dense(3 * self.width, use_bias=self.qkv_bias, kernel_init=self.kernel_init, dtype=self.dtype)
    self.proj = nn.Dense(self.width, kernel_init=self.kernel_init, dtype=self.dtype)
    self.drop = nn.Dropout(self.proj_drop)

  def __call__(self, x: Array, *, mask: attn_lib.Mask = None, kv: Optional[attn_lib.KVCache] = None,
               kv_hook: Optional[Callable] = None, deterministic: bool = True, project: bool = True):
    """Returns (out, kv, kv_hook's state). With a cache, x's keys and values are appended and
    the queries see every cached one. `kv_hook(k, v) -> (k, v, state)` instead replaces
    them by what a policy's cache holds; without it state is None. project=False: out is (`proj`'s
    product without its bias, the bias), for a caller that fuses the bias with what follows
    (`blocks.unbiased`)."""
    b, l, c = x.shape
    h = self.num_heads
    qkv = self.qkv(x).reshape(b, l, 3, h, c // h)
    # Without a cache or hook, `attention` takes qkv packed (a backend may read it in place).
    q, k, v = (qkv, None, None) if kv_hook is None and kv is None else jnp.moveaxis(qkv, 2, 0)
    state, kv_len = None, None
    if kv_hook is not None:
      k, v, state = kv_hook(k, v)
    if kv is not None:
      k, v, kv_len, kv = kv.attend(k, v, mask)
    dropping = not deterministic and self.attn_drop > 0
    out = attn_lib.attention(q, k, v, mask=mask, backend=self.backend, kv_len=kv_len,
                             dropout_rate=self.attn_drop if dropping else 0.0,
                             dropout_rng=self.make_rng('dropout') if dropping else None)
    out = out.reshape(b, l, c)
    if not project:
      return unbiased(self.proj, out), kv, state
    return self.drop(self.proj(out), deterministic=deterministic), kv, state


def _gelu_float32(x: Array) -> Array:
  return jax.nn.gelu(x.astype(jnp.float32), approximate=False)


@jax.custom_vjp
def gelu_exact(x: Array) -> Array:
  """Exact (erf) GELU as torch computes it on any dtype: in float32, rounded once to x's dtype.
  The backward recomputes it from x alone, so training keeps one tensor of x's dtype per call
  (autodiff of the float32 form would keep three float32 intermediates). [...] -> [...]"""
  return _gelu_float32(x).astype(x.dtype)


def _gelu_exact_forward(x: Array):
  return gelu_exact(x), x


def _gelu_exact_backward(x: Array, grad: Array):
  _, vjp = jax.vjp(_gelu_float32, x.astype(jnp.float32))
  return (vjp(grad.astype(jnp.float32))[0].astype(x.dtype),)


gelu_exact.defvjp(_gelu_exact_forward, _gelu_exact_backward)


class Mlp(nn.Module):
  """fc1 -> exact GELU -> dropout -> fc2 -> dropout. [B, l, C] -> [B, l, C]."""
  width: int
  hidden: int
  drop: float = 0.0
  kernel_init: Callable = xavier_uniform
  dtype: Any = jnp.float32

  def setup(self):
    self.fc1 = nn.Dense(self.hidden, kernel_init=self.kernel_init, dtype=self.dtype)
    self.fc2 = nn.Dense(self.width, kernel_init=self.kernel_init, dtype=self.dtype)
    self.dropout = nn.Dropout(self.drop)

  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    x = self.dropout(gelu_exact(self.fc1(x)), deterministic=deterministic)
    return self.dropout(self.fc2(x), deterministic=deterministic)


class Block(nn.Module):
  """timm's ViT Block. x [B, l, C] -> [B, l, C].

  Default initialisation is MAE/MAR's: xavier-uniform Linear weights, zero
  biases, LayerNorm 1/0.
  """
  width: int
  num_heads: int
  mlp_ratio: float = 4.0
  qkv_bias: bool = True
  norm_eps: float = 1e-6
  attn_drop: float = 0.0
  proj_drop: float = 0.0
  drop_path_rate: float = 0.0
  kernel_init: Callable = xavier_uniform
  backend: str = 'xla'
  dtype: Any = jnp.float32

  def setup(self):
    c = self.width
    self.norm1 = torch_layer_norm(self.norm_eps, self.dtype)
    self.attn = Attention(c, self.num_heads, self.qkv_bias, self.attn_drop, self.proj_drop, self.kernel_init,
                          self.backend, self.dtype)
    self.norm2 = torch_layer_norm(self.norm_eps, self.dtype)
    # int(), not round(): timm truncates the hidden width.
    self.mlp = Mlp(c, int(c * self.mlp_ratio), self.proj_drop, self.kernel_init, self.dtype)

  def __call__(self, x: Array, *, mask: attn_lib.Mask = None, kv: Optional[attn_lib.KVCache] = None,
               hooks: Optional[BlockHooks] = None, state: Any = None, deterministic: bool = True):
    """Returns (x, kv, state). `mask` applies to the keys the attention sees: x's tokens (after
    the cache's, with `kv`), or what `hooks.kv` returns; hooks carry `state` as in
    `blocks.residual`, and only the tokens they forward enter the cache."""
    def attn_branch(h, idx, state):
      kv_hook = None if hooks is None else (lambda k, v: hooks.kv(k, v, idx, state))
      out, new_kv, hook_state = self.attn(self.norm1(h), mask=mask, kv=kv, kv_hook=kv_hook,
                                          deterministic=deterministic)
      return out, new_kv, state if hooks is None else hook_state

    def mlp_branch(h, idx, state):
      return self.mlp(self.norm2(h), deterministic), None, state

    x, new_kv, state = residual(self, x, attn_branch, 'attn', hooks, state, self.drop_path_rate, deterministic)
    x, _, state = residual(self, x, mlp_branch, 'ffn', hooks, state, self.drop_path_rate, deterministic)
    return x, new_kv, state
