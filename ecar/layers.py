"""E-CAR's transformer layers: the AR's pre-LN ViT block with a KV cache, the denoisers'
DiT block whose adaLN modulation varies per token, and patch (un)folding.

`ARBlock` is timm's ViT block (`var_models.vit.Block`: affine LayerNorm, qkv
with bias, exact GELU) with one addition the shared block lacks: its attention
can append to and read from a `KVCache`, so the sampler runs one stage at a
time. Both of its sub-layers go through `blocks.residual`, the policy hook point.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from var_models import attention as attn_lib
from var_models.blocks import FFN, BlockHooks, layer_norm, modulate, residual
from var_models.vit import Mlp, torch_layer_norm, xavier_uniform

Array = jax.Array
_zeros = nn.initializers.zeros


def patchify(x: Array, p: int) -> Array:
  """[B, H, W, C] -> [B, (H/p)(W/p), p*p*C], tokens row-major, each patch (row, col, channel)."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(x: Array, p: int, side: int) -> Array:
  """Inverse of `patchify` for a square grid of `side`: [B, N, p*p*C] -> [B, side, side, C]."""
  b, n, d = x.shape
  c, g = d // (p * p), side // p
  x = x.reshape(b, g, g, p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, side, side, c)


class SelfAttention(nn.Module):
  """Multi-head attention with a fused qkv (bias) and an optional KV cache. x [B, l, C] -> [B, l, C]."""
  width: int
  num_heads: int
  backend: str = 'xla'
  dtype: Any = jnp.float32

  def setup(self):
    self.qkv = nn.Dense(3 * self.width, kernel_init=xavier_uniform, dtype=self.dtype)
    self.proj = nn.Dense(self.width, kernel_init=xavier_uniform, dtype=self.dtype)

  def __call__(self, x: Array, *, mask: attn_lib.Mask = None, kv: Optional[attn_lib.KVCache] = None):
    """Returns (out, kv); with a cache, this call's k and v are appended and every cached key is seen."""
    b, l, c = x.shape
    h = self.num_heads
    q, k, v = jnp.moveaxis(self.qkv(x).reshape(b, l, 3, h, c // h), 2, 0)
    kv_len = None
    if kv is not None:
      kv = kv.append(k, v)
      if mask is None:  # read the buffer in place
        k, v, kv_len = kv.k, kv.v, kv.length
      else:
        k, v = kv.keys(), kv.values()
    out = attn_lib.attention(q, k, v, mask=mask, backend=self.backend, kv_len=kv_len)
    return self.proj(out.reshape(b, l, c)), kv


class ARBlock(nn.Module):
  """Pre-LN ViT block. x [B, l, C] -> [B, l, C]."""
  width: int
  num_heads: int
  mlp_ratio: float
  backend: str = 'xla'
  dtype: Any = jnp.float32

  def setup(self):
    self.norm1 = torch_layer_norm(1e-6, self.dtype)
    self.attn = SelfAttention(self.width, self.num_heads, self.backend, self.dtype)
    self.norm2 = torch_layer_norm(1e-6, self.dtype)
    self.mlp = Mlp(self.width, int(self.width * self.mlp_ratio), dtype=self.dtype)

  def __call__(self, x: Array, *, mask: attn_lib.Mask = None, kv: Optional[attn_lib.KVCache] = None,
               hooks: Optional[BlockHooks] = None, state: Any = None):
    """Returns (x, kv, state); hooks (from a sampling policy) select and restore tokens around
    each sub-layer as in `blocks.residual`, and only the forwarded tokens enter the cache."""
    def attn_branch(h, idx, state):
      return (*self.attn(self.norm1(h), mask=mask, kv=kv), state)

    def mlp_branch(h, idx, state):
      return self.mlp(self.norm2(h)), None, state

    x, new_kv, state = residual(self, x, attn_branch, 'attn', hooks, state, 0.0, True)
    x, _, state = residual(self, x, mlp_branch, 'ffn', hooks, state, 0.0, True)
    return x, new_kv, state


class DiTBlock(nn.Module):
  """DiT block whose six modulation vectors come per token from c [B, l, C] (E-CAR's spatially
  varying condition). x [B, l, C] -> [B, l, C]. adaLN-zero: the block starts as the identity."""
  width: int
  num_heads: int
  mlp_ratio: float
  backend: str = 'xla'
  dtype: Any = jnp.float32

  def setup(self):
    w = self.width
    self.adaLN_modulation = nn.Dense(6 * w, kernel_init=_zeros, dtype=self.dtype)
    self.norm = layer_norm(1e-6, self.dtype)
    self.attn = SelfAttention(w, self.num_heads, self.backend, self.dtype)
    self.mlp = FFN(w, int(w * self.mlp_ratio), xavier_uniform, xavier_uniform, dtype=self.dtype)

  def __call__(self, x: Array, c: Array) -> Array:
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(self.adaLN_modulation(nn.silu(c)), 6, axis=-1)
    x = x + gate1 * self.attn(modulate(self.norm(x), scale1, shift1))[0]
    return x + gate2 * self.mlp(modulate(self.norm(x), scale2, shift2))


class FinalLayer(nn.Module):
  """Per-token adaLN (shift, scale) then Linear to the patch values, zero-initialised. [B, l, C] -> [B, l, D]."""
  width: int
  out_dim: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, c: Array) -> Array:
    shift, scale = jnp.split(nn.Dense(2 * self.width, kernel_init=_zeros, dtype=self.dtype,
                                      name='adaLN_modulation')(nn.silu(c)), 2, axis=-1)
    x = modulate(layer_norm(1e-6, self.dtype)(x), scale, shift)
    return nn.Dense(self.out_dim, kernel_init=_zeros, dtype=self.dtype, name='linear')(x)
