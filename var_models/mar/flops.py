"""Model FLOPs of MAR sampling: the computation the official code runs, counted piece by piece on
jaxprs with `var_models.flop_count` (2 FLOPs per multiply-add, attention matmuls included).

The compiled sampler runs static shapes: its encoder sees the known positions padded to a few
lengths (or every position, masked keys) and its head the largest prediction count of any
iteration, so its own jaxpr counts more than the model
needs. This counts what the official `sample_tokens` computes instead: at every iteration the
encoder on the buffer plus the known tokens, the decoder on every position, and the head's
diffusion steps on the tokens the iteration predicts; with CFG both halves of each. The VAE
decoder is reported apart ('decode').
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from var_models.flop_count import flops
from var_models.mar.diffloss import diffloss_sample, merged_adaln
from var_models.mar.gaussian_diffusion import create_diffusion
from var_models.mar.model import MAR, MARConfig, diffloss_net, init_params
from var_models.mar.schedule import mask_schedule
from var_models.tokenizers.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig

KEY = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)


def sampling_flops(cfg: MARConfig, vae_cfg: AutoencoderKLConfig, *, num_iter: int = 64,
                   num_steps: int = 100, guided: bool = True) -> dict:
  """{'per_image', 'per_image_without_decode', 'transformer', 'head', 'decode'}: FLOPs of
  sampling one image with the official schedule (`num_iter` iterations, `num_steps` head steps)."""
  rows = 2 if guided else 1
  model, params = MAR(cfg), jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))

  def transformer(known: int) -> float:
    def run(p, tokens, class_emb, keep):
      return model.apply({'params': p}, tokens, class_emb, keep,
                         method=lambda m, t, c, k: m.decode(m.encode(t, None, c, k), None, k))
    return flops(run, params, sds(rows, cfg.seq_len, cfg.token_embed_dim), sds(rows, cfg.encoder_embed_dim),
                 jax.ShapeDtypeStruct((rows, cfg.buffer_size + known), jnp.int32))

  def head(n: int) -> float:   # its adaLN weights merged once per call by the sampler, not counted here
    net, diffusion = diffloss_net(cfg), create_diffusion(str(num_steps))
    adaln = jax.eval_shape(merged_adaln, params['diffloss'])
    return flops(lambda p, a, z, k: diffloss_sample(net, p, z, k, 1.0, 2.0, guided=guided, diffusion=diffusion,
                                                    adaln=a),
                 params['diffloss'], adaln, sds(rows * n, cfg.decoder_embed_dim), KEY)

  # The encoder's count is quadratic in its token count (Linears linear, attention quadratic) and
  # the head's linear in its rows, so a few traced sizes give every iteration's count exactly.
  sched = mask_schedule(cfg.seq_len, num_iter)
  trans = polynomial(transformer, (1, cfg.seq_len // 2, cfg.seq_len))
  trans = float(sum(trans(cfg.seq_len - int(m)) for m in sched.masked))
  head_count = polynomial(head, (1, 2))
  heads = float(sum(head_count(int(n)) for n in sched.n_pred))
  decode = decode_flops(cfg, vae_cfg)
  return {'per_image': trans + heads + decode, 'per_image_without_decode': trans + heads,
          'transformer': trans, 'head': heads, 'decode': decode}


def decode_flops(cfg: MARConfig, vae_cfg: AutoencoderKLConfig) -> float:
  """FLOPs of the KL VAE decoding one image's latents."""
  latent, vae = cfg.img_size // cfg.vae_stride, AutoencoderKL(vae_cfg)
  params = jax.eval_shape(lambda k: vae.init(k, jnp.zeros((1, latent, latent, vae_cfg.embed_dim)),
                                             method=AutoencoderKL.decode)['params'], jax.random.key(0))
  return flops(lambda p, x: vae.apply({'params': p}, x, method=AutoencoderKL.decode), params,
               sds(1, latent, latent, vae_cfg.embed_dim))


def sds(*shape: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def polynomial(count: Callable[[int], float], sizes: Sequence[int]) -> Callable[[int], float]:
  """The polynomial of degree len(sizes) - 1 through count(size) at `sizes`."""
  coeffs = np.polyfit(np.asarray(sizes, np.float64), [count(n) for n in sizes], len(sizes) - 1)
  return lambda n: float(np.polyval(coeffs, n))
