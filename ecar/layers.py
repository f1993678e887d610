"""E-CAR's denoiser layers: the DiT block whose adaLN modulation varies per token, its final
layer, and patch (un)folding. The AR's block is the shared timm ViT block
(`var_models.nn.vit.Block`), whose attention appends to and reads a `KVCache`."""
from __future__ import annotations

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

import pallas_kernels as pk
from var_models.nn.blocks import FFN, concat_dense, layer_norm, modulate
from var_models.nn.vit import Attention, xavier_uniform

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
    self.attn = Attention(w, self.num_heads, backend=self.backend, dtype=self.dtype)
    self.mlp = FFN(w, int(w * self.mlp_ratio), xavier_uniform, xavier_uniform, dtype=self.dtype)

  def __call__(self, x: Array, c: Array, mod: Optional[Array] = None) -> Array:
    """mod [B, l, 6C]: this block's adaLN output when the caller computed it (`merged_adaln`)."""
    if mod is None:
      mod = self.adaLN_modulation(nn.silu(c))
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod, 6, axis=-1)
    x = x + gate1 * self.attn(modulate(self.norm(x), scale1, shift1))[0]
    return x + gate2 * self.mlp(modulate(self.norm(x), scale2, shift2))

  def chained(self, x: Array, h: Array, mods: Array, slot: int, next_slots: tuple[int, int]) -> tuple[Array, Array]:
    """The block as a sampler on a few rows runs it, each sub-layer's gated residual and the next
    LayerNorm and modulation one `pallas_kernels.residual_norm` (three XLA kernels otherwise):
    x [B, l, C] float32, h its first sub-layer's input (made by the block before, or
    `modulated_norm`), mods [B, l, K, C] a denoiser's adaLN outputs (this block's six from
    `slot`), next_slots: the (shift, scale) slots of the LayerNorm after the block -> (x after the
    block, that LayerNorm's modulated output). The same values as __call__ (to rounding)."""
    b, l, c = x.shape
    rows = lambda a: a.reshape(b * l, *a.shape[2:])
    residual_norm = functools.partial(pk.residual_norm, mod=rows(mods), eps=self.norm.epsilon)
    y, bias = self.attn(h, project=False)[0]
    x, h = residual_norm(rows(x), rows(y), bias, slots=(slot + 2, slot + 3, slot + 4))
    y, bias = self.mlp(h.reshape(b, l, c), project=False)
    x, h = residual_norm(x, rows(y), bias, slots=(slot + 5, *next_slots))
    return x.reshape(b, l, c), h.reshape(b, l, c)

  def modulated_norm(self, x: Array, mods: Array, slot: int) -> Array:
    """The first sub-layer's input of `chained`: x's LayerNorm modulated by mods[..., slot + (0, 1), :]."""
    return modulate(self.norm(x), mods[..., slot + 1, :], mods[..., slot, :])


class FinalLayer(nn.Module):
  """Per-token adaLN (shift, scale) then Linear to the patch values, zero-initialised. [B, l, C] -> [B, l, D]."""
  width: int
  out_dim: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, c: Array, mod: Optional[Array] = None, normed: bool = False) -> Array:
    """normed: x is already the modulated LayerNorm (`DiTBlock.chained`'s second output)."""
    if not normed:
      if mod is None:
        mod = nn.Dense(2 * self.width, kernel_init=_zeros, dtype=self.dtype, name='adaLN_modulation')(nn.silu(c))
      shift, scale = jnp.split(mod, 2, axis=-1)
      x = modulate(layer_norm(1e-6, self.dtype)(x), scale, shift)
    return nn.Dense(self.out_dim, kernel_init=_zeros, dtype=self.dtype, name='linear')(x)


def merged_adaln(params) -> tuple[Array, Array]:
  """Every DiT block's and the final layer's adaLN Linear of one denoiser, concatenated (they all
  read the same SiLU(c)): (kernel [w, (6 depth + 2) w], bias), see `concat_dense`."""
  depth = sum(1 for k in params if k.startswith('blocks_') and k[len('blocks_'):].isdigit())
  return concat_dense([params[f'blocks_{i}']['adaLN_modulation'] for i in range(depth)]
                      + [params['final']['adaLN_modulation']])
