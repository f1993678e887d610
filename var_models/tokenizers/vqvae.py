"""VAR's multi-scale residual VQVAE (tokenizer), NHWC.

An image is encoded to f [B, H, W, Cvae] (H = W = patch_nums[-1]). Scale k
quantizes the area-downsampled residual to a pn_k x pn_k token map, whose
codebook vectors are bicubic-upsampled back to H x W, refined by a conv phi
and added to f_hat. The quantizer always runs in float32 (the official code
disables autocast there), whatever the conv compute dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from var_models.nn.resample import area_resize, bicubic_resize
from var_models.tokenizers.conv_vae import Decoder, Encoder

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class VQVAEConfig:
  """Defaults are the official checkpoint vae_ch160v4096z32.pth (256 px, 16x16 latents)."""
  vocab_size: int = 4096
  z_channels: int = 32
  ch: int = 160
  ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
  num_res_blocks: int = 2
  dropout: float = 0.0
  beta: float = 0.25
  using_znorm: bool = False
  quant_conv_ks: int = 3
  quant_resi: float = 0.5
  share_quant_resi: int = 4
  default_qresi_counts: int = 0
  patch_nums: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
  using_sa: bool = True
  using_mid_sa: bool = True
  dtype: Any = jnp.float32
  attn_backend: str = 'xla'

  def __post_init__(self):
    if len(self.patch_nums) < 2:
      raise ValueError(f'VQVAE needs at least 2 scales, got patch_nums={self.patch_nums}')

  @property
  def num_scales(self) -> int:
    return len(self.patch_nums)

  @property
  def downsample(self) -> int:
    return 2 ** (len(self.ch_mult) - 1)

  @property
  def image_size(self) -> int:
    return self.patch_nums[-1] * self.downsample

  @property
  def num_phis(self) -> int:
    """How many phi convs the checkpoint holds (0 when quant_resi ~ 0 makes phi the identity)."""
    if abs(self.quant_resi) <= 1e-6:
      return 0
    if self.share_quant_resi == 0:
      return self.default_qresi_counts or self.num_scales
    return 1 if self.share_quant_resi == 1 else self.share_quant_resi


def phi_index(si: int, num_scales: int, num_phis: int) -> int:
  """Which of `num_phis` phi convs refines scale `si`: the tick nearest si / (num_scales - 1)."""
  k = num_phis
  ticks = np.linspace(1 / 3 / k, 1 - 1 / 3 / k, k) if k == 4 else np.linspace(1 / 2 / k, 1 - 1 / 2 / k, k)
  return int(np.argmin(np.abs(ticks - si / (num_scales - 1))))


class Phi(nn.Module):
  """h [B, H, W, C] -> (1 - r) h + r conv3x3(h)."""
  ratio: float

  @nn.compact
  def __call__(self, h: jax.Array) -> jax.Array:
    conv = nn.Conv(h.shape[-1], (3, 3), padding=((1, 1), (1, 1)), name='conv')
    return h * (1 - self.ratio) + conv(h) * self.ratio


def _mse(a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.mean(jnp.square(a - b))


class VQVAE(nn.Module):
  """Initialise with `__call__` (the only method that touches every parameter)."""
  cfg: VQVAEConfig

  def setup(self):
    c = self.cfg
    arch = dict(ch=c.ch, ch_mult=tuple(c.ch_mult), num_res_blocks=c.num_res_blocks, using_sa=c.using_sa,
                using_mid_sa=c.using_mid_sa, dropout=c.dropout, dtype=c.dtype, attn_backend=c.attn_backend)
    self.encoder = Encoder(z_channels=c.z_channels, double_z=False, **arch)
    self.decoder = Decoder(out_channels=3, **arch)
    pad = ((c.quant_conv_ks // 2,) * 2,) * 2
    self.quant_conv = nn.Conv(c.z_channels, (c.quant_conv_ks,) * 2, padding=pad, dtype=c.dtype)
    self.post_quant_conv = nn.Conv(c.z_channels, (c.quant_conv_ks,) * 2, padding=pad, dtype=c.dtype)
    self.embedding = nn.Embed(c.vocab_size, c.z_channels, embedding_init=nn.initializers.normal(1.0))
    self.quant_resi = [Phi(abs(c.quant_resi)) for _ in range(c.num_phis)]

  # ----- conv parts -----

  def encode(self, img: jax.Array, train: bool = False) -> jax.Array:
    """img [B, H, W, 3] in [-1, 1] -> f [B, h, w, Cvae] (encoder + quant_conv)."""
    return self.quant_conv(self.encoder(img, train))

  def decode(self, f_hat: jax.Array, train: bool = False) -> jax.Array:
    """f_hat [B, h, w, Cvae] -> img [B, H, W, 3], unclamped (post_quant_conv + decoder)."""
    return self.decoder(self.post_quant_conv(f_hat), train)

  def fhat_to_img(self, f_hat: jax.Array) -> jax.Array:
    """f_hat [B, h, w, Cvae] -> img [B, H, W, 3] clamped to [-1, 1]."""
    return jnp.clip(self.decode(f_hat), -1.0, 1.0)

  # ----- quantizer -----

  def embed(self, indices: jax.Array) -> jax.Array:
    """int indices [...] -> codebook vectors [..., Cvae] (float32)."""
    return jnp.take(self.embedding.embedding, indices, axis=0)

  def _nearest(self, z: jax.Array) -> jax.Array:
    """z [N, C] float32 -> [N] int32 nearest code; argmin/argmax keep the first optimum like torch."""
    e = jax.lax.stop_gradient(self.embedding.embedding)
    if self.cfg.using_znorm:
      unit = lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
      return jnp.argmax(jnp.dot(unit(z), unit(e).T, precision=_HIGHEST), axis=1).astype(jnp.int32)
    d = jnp.sum(z * z, axis=1, keepdims=True) + jnp.sum(e * e, axis=1)
    d = d - 2 * jnp.dot(z, e.T, precision=_HIGHEST)
    return jnp.argmin(d, axis=1).astype(jnp.int32)

  def _phi(self, si: int, h: jax.Array) -> jax.Array:
    if not self.quant_resi:
      return h
    return self.quant_resi[phi_index(si, self.cfg.num_scales, len(self.quant_resi))](h)

  def _scale_residual(self, si: int, h: jax.Array) -> jax.Array:
    """Codes of scale si [B, pn, pn, C] -> phi(upsampled) [B, H, W, C]; the last scale is not resized."""
    if si != self.cfg.num_scales - 1:
      full = self.cfg.patch_nums[-1]
      h = bicubic_resize(h, (full, full))
    return self._phi(si, h)

  def _code_map(self, si: int, idx: jax.Array) -> jax.Array:
    """[B, pn*pn] indices -> [B, pn, pn, C] codebook vectors."""
    pn = self.cfg.patch_nums[si]
    if idx.ndim != 2 or idx.shape[1] != pn * pn:
      raise ValueError(f'scale {si} expects indices [B, {pn * pn}], got {idx.shape}')
    return self.embed(idx).reshape(idx.shape[0], pn, pn, self.cfg.z_channels)

  def _residual_quantize(self, f: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """f [B, H, W, C] -> (indices [B, pn*pn] per scale, cumulative f_hat [B, H, W, C] per scale)."""
    f = f.astype(jnp.float32)
    b, hh, ww, c = f.shape
    pns = self.cfg.patch_nums
    if hh != pns[-1] or ww != pns[-1]:
      raise ValueError(f'f has spatial size {(hh, ww)}, the last scale is {pns[-1]}')
    f_rest, f_hat = jax.lax.stop_gradient(f), jnp.zeros_like(f)
    indices, f_hats = [], []
    for si, pn in enumerate(pns):
      z = f_rest if si == len(pns) - 1 else area_resize(f_rest, (pn, pn))
      idx = self._nearest(z.reshape(-1, c)).reshape(b, pn * pn)
      h = self._scale_residual(si, self._code_map(si, idx))
      f_hat, f_rest = f_hat + h, f_rest - h
      indices.append(idx)
      f_hats.append(f_hat)
    return indices, f_hats

  def f_to_indices(self, f: jax.Array) -> list[jax.Array]:
    """f [B, H, W, Cvae] -> per-scale token maps [B, pn*pn] int32 (row-major)."""
    return self._residual_quantize(f)[0]

  def f_to_fhats(self, f: jax.Array) -> list[jax.Array]:
    """f [B, H, W, Cvae] -> per-scale cumulative f_hat [B, H, W, Cvae]."""
    return self._residual_quantize(f)[1]

  def img_to_indices(self, img: jax.Array) -> list[jax.Array]:
    """img [B, H, W, 3] -> per-scale token maps [B, pn*pn] int32."""
    return self.f_to_indices(self.encode(img))

  def indices_to_fhat(self, indices: Sequence[jax.Array], return_all: bool = False):
    """Token maps of the first len(indices) scales -> f_hat [B, H, W, Cvae] (or the per-scale list)."""
    if len(indices) > self.cfg.num_scales:
      raise ValueError(f'{len(indices)} token maps for {self.cfg.num_scales} scales')
    full = self.cfg.patch_nums[-1]
    f_hat = jnp.zeros((indices[0].shape[0], full, full, self.cfg.z_channels), jnp.float32)
    f_hats = []
    for si, idx in enumerate(indices):
      f_hat = f_hat + self._scale_residual(si, self._code_map(si, idx))
      f_hats.append(f_hat)
    return f_hats if return_all else f_hat

  def indices_to_img(self, indices: Sequence[jax.Array]) -> jax.Array:
    """Token maps of all scales -> img [B, H, W, 3] clamped."""
    return self.fhat_to_img(self.indices_to_fhat(indices))

  def indices_to_var_input(self, indices: Sequence[jax.Array]) -> jax.Array:
    """Teacher-forcing input of VAR: [B, L - pn_0^2, Cvae], scale k+1's input = area(f_hat after k)."""
    pns = self.cfg.patch_nums
    full = pns[-1]
    b = indices[0].shape[0]
    f_hat = jnp.zeros((b, full, full, self.cfg.z_channels), jnp.float32)
    nexts = []
    for si in range(len(pns) - 1):
      f_hat = f_hat + self._scale_residual(si, self._code_map(si, indices[si]))
      nexts.append(area_resize(f_hat, (pns[si + 1],) * 2).reshape(b, -1, self.cfg.z_channels))
    return jnp.concatenate(nexts, axis=1)

  def next_ar_input(self, si: int, f_hat: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sampler step: adds scale si's codes h [B, pn, pn, Cvae] to f_hat [B, H, W, Cvae].

    Returns (f_hat, next scale's input [B, pn_next, pn_next, Cvae]); at the last scale (f_hat, f_hat).
    """
    f_hat = f_hat + self._scale_residual(si, h.astype(jnp.float32))
    if si == self.cfg.num_scales - 1:
      return f_hat, f_hat
    return f_hat, area_resize(f_hat, (self.cfg.patch_nums[si + 1],) * 2)

  # ----- training -----

  def __call__(self, img: jax.Array, train: bool = False) -> tuple[jax.Array, jax.Array]:
    """img [B, H, W, 3] -> (unclamped reconstruction [B, H, W, 3], scalar VQ loss).

    Loss = mean over scales of beta * |sg(f_hat_k) - f|^2 + |f_hat_k - sg(f)|^2 (codebook and
    phi learn from the second term); the decoder sees f_hat through the straight-through estimator.
    """
    sg = jax.lax.stop_gradient
    f = self.encode(img, train).astype(jnp.float32)
    _, f_hats = self._residual_quantize(f)
    if self.is_initializing():  # phis that no scale maps to still belong in the param tree
      for phi in self.quant_resi:
        phi(f)
    vq_loss = sum(self.cfg.beta * _mse(sg(fh), f) + _mse(fh, sg(f)) for fh in f_hats) / len(f_hats)
    f_st = (sg(f_hats[-1]) - sg(f)) + f
    return self.decode(f_st, train), vq_loss
