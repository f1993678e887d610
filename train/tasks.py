"""Each model family behind one interface the trainer drives.

A `Task` holds pure functions (all jit-compiled by the trainer):
  init(key) -> (params, model_state)       trainable params and the family's extra state
                                           (E-CAR's GradNorm state; {} for VAR and MAR)
  inputs(frozen, batch, key) -> inputs     the frozen tokenizer turns a batch {'image' uint8
                                           [B, H, W, 3] (or 'moments'), 'label' [B]} into the
                                           model's inputs (no gradient flows into it)
  loss(params, model_state, inputs, labels, key) -> (loss, (metrics, new model_state))
                                           the model state advances with every loss evaluation
                                           (each micro-batch), as the VQVAE's counter does; or,
                                           for a task with update_state, -> (loss, (metrics, stats))
  update_state(model_state, stats) -> (model_state, metrics)
                                           optional: a model state that changes once per
                                           optimizer step (E-CAR's GradNorm), from the loss's
                                           stats (float arrays) averaged over the micro-batches
  taps() -> zeros                          optional, with update_state: a last argument of
                                           loss, differentiated with the params; its gradient
                                           is stats['taps'] (E-CAR: GradNorm's per-stage
                                           gradients on the final norm, from the one backward)
  sample(params, frozen, key, labels) -> images [B, H, W, 3] in [0, 1]
and `frozen`, the tokenizer's parameters (loaded from the config's checkpoint, or
random with a warning when none is named). A tokenizer's own task (the VQVAE)
has no sampler (its frozen part is the perceptual loss's network, not exported);
it `reconstruct`s images instead:
  reconstruct(params, images uint8 [B, H, W, 3]) -> reconstructions [B, H, W, 3] in [0, 1].
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from sampling import sampling_from_config
from train.validate import check_vqvae_loss
from var_models import checkpoint
from var_models.mar import model as mar_lib
from var_models.mar.from_config import mar_configs
from var_models.nn.checks import compute_dtype
from var_models.tokenizers import lpips as lpips_lib
from var_models.tokenizers.autoencoder_kl import AutoencoderKL, sample_posterior
from var_models.tokenizers.patch_discriminator import PatchDiscriminator, discriminator_hinge_loss, generator_loss
from var_models.tokenizers.vqvae import VQVAE
from var_models.var import model as var_lib
from var_models.var.from_config import var_configs, vqvae_config

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Task:
  family: str
  image_size: int
  num_classes: int
  init: Callable[[Array], tuple[Any, Any]]
  frozen: Any
  inputs: Callable[[Any, dict, Array], Any]
  loss: Callable[..., tuple[Array, tuple[dict, Any]]]
  sample: Optional[Callable[[Any, Any, Array, Array], Array]]
  names: tuple[str, Optional[str]]  # (trained, frozen) keys of an exported params checkpoint
  # KL-VAE latent spaces (MAR, E-CAR on VAE latents), for the latent cache:
  # images uint8 [B, H, W, 3] -> posterior moments [B, h, w, 2C] (mean, logvar).
  moments: Optional[Callable[[Any, Array], Array]] = None
  reconstruct: Optional[Callable[[Any, Array], Array]] = None
  # Trained params -> the part exported as names[0] (None: all of them), e.g. a tokenizer
  # without the discriminator it trained with.
  export: Optional[Callable[[Any], Any]] = None
  update_state: Optional[Callable[[Any, Any], tuple[Any, dict]]] = None
  taps: Optional[Callable[[], Any]] = None


def to_unit_range(images: Array) -> Array:
  """uint8 [B, H, W, 3] -> float32 in [-1, 1]."""
  return images.astype(jnp.float32) / 127.5 - 1.0


def _vqvae_shapes(vq_cfg, key):
  img = jnp.zeros((1, vq_cfg.image_size, vq_cfg.image_size, 3), jnp.float32)
  return VQVAE(vq_cfg).init(key, img)['params']


def _vae_shapes(vae_cfg, key):
  img = jnp.zeros((1, vae_cfg.downsample, vae_cfg.downsample, 3), jnp.float32)
  return AutoencoderKL(vae_cfg).init(key, img, key)['params']


def random_stand_in(abstract, seed: int):
  """NumPy parameters shaped like `abstract`: a random tokenizer for runs without a checkpoint.

  Kernels ~ N(0, 1 / fan_in), codebooks ~ N(0, 1), norm scales 1, biases 0. Drawn
  without compiling the tokenizer's init (slow for conv nets on a CPU).
  """
  rng = np.random.default_rng(seed)

  def one(path, x):
    name = str(getattr(path[-1], 'key', path[-1]))
    if name == 'scale':
      return np.ones(x.shape, np.float32)
    if name == 'bias' or x.ndim < 2:
      return np.zeros(x.shape, np.float32)
    std = 1.0 if name == 'embedding' else 1 / np.sqrt(np.prod(x.shape[:-1]))
    return (rng.standard_normal(x.shape) * std).astype(np.float32)
  return jax.tree_util.tree_map_with_path(one, abstract)


def _frozen(path: str, name: str, shapes: Callable[[Any, Array], Any], cfg, seed: int, config_key: str):
  """The tokenizer from a checkpoint directory, else a random stand-in."""
  abstract = jax.eval_shape(functools.partial(shapes, cfg), jax.random.key(seed))
  if path:
    return checkpoint.load_component(path, name, abstract)
  logging.warning('config.%s is empty: the frozen %s is random, so samples will not look like the data',
                  config_key, name)
  return random_stand_in(abstract, seed)


def _sampler(config) -> Callable[[Any, Any, Array, Array], Array]:
  """sample(params, frozen, key, labels) -> images: the config's sampler with its `sample` settings
  (`sampling.sampling_from_config`), checked at start-up, not at the first grid."""
  s = sampling_from_config(config)
  sampler, (trained, tokenizer) = s.make(), s.names

  def sample(params, frozen, key, labels):
    return sampler({trained: params, tokenizer: frozen}, key, labels, **s.opts)[0]
  return sample


def _per_scale_nll(logits: Array, targets: Array, begin_ends) -> dict:
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return {f'loss/scale_{i}': jnp.mean(nll[:, b:e]) for i, (b, e) in enumerate(begin_ends)}


def var_task(config) -> Task:
  var_cfg, vq_cfg = var_configs(config)
  model, vq = var_lib.VAR(var_cfg), VQVAE(vq_cfg)
  frozen = _frozen(config.vqvae_ckpt, 'vqvae', _vqvae_shapes, vq_cfg, config.train.seed + 1, 'vqvae_ckpt')
  begin_ends = var_cfg.schedule.begin_ends

  def inputs(frozen, batch, key):
    del key
    idx = vq.apply({'params': frozen}, to_unit_range(batch['image']), method=VQVAE.img_to_indices)
    x_tf = vq.apply({'params': frozen}, idx, method=VQVAE.indices_to_var_input)
    return jax.lax.stop_gradient(x_tf), jnp.concatenate(idx, axis=1)

  def loss(params, model_state, inputs, labels, key):
    x_tf, targets = inputs
    ce, logits = var_lib.loss_fn(model, params, labels, x_tf, targets, train=True, rng=key)
    return ce, (_per_scale_nll(logits, targets, begin_ends), model_state)

  return Task('var', vq_cfg.image_size, var_cfg.num_classes, lambda k: (var_lib.init_params(var_cfg, k), {}),
              frozen, inputs, loss, _sampler(config), ('var', 'vqvae'))


def _kl_moments(vae: AutoencoderKL):
  """images uint8 [B, H, W, 3] -> posterior moments [B, h, w, 2C] (mean, logvar) of a KL VAE."""
  def moments(frozen, images):
    mean, logvar = vae.apply({'params': frozen}, to_unit_range(images), method=AutoencoderKL.encode)
    return jnp.concatenate([mean, logvar], axis=-1)
  return moments


def _posterior_draw(moments: Array, scale: float, key: Array) -> Array:
  """A scaled posterior sample from moments [B, h, w, 2C] -> [B, h, w, C]."""
  mean, logvar = jnp.split(moments.astype(jnp.float32), 2, axis=-1)
  return jax.lax.stop_gradient(sample_posterior(mean, logvar, key) * scale)


def mar_task(config) -> Task:
  mar_cfg, vae_cfg = mar_configs(config)
  model = mar_lib.MAR(mar_cfg)
  frozen = _frozen(config.vae_ckpt, 'vae', _vae_shapes, vae_cfg, config.train.seed + 1, 'vae_ckpt')
  moments = _kl_moments(AutoencoderKL(vae_cfg))

  def inputs(frozen, batch, key):
    m = batch['moments'] if 'moments' in batch else moments(frozen, batch['image'])
    return _posterior_draw(m, vae_cfg.scaling_factor, key)

  def loss(params, model_state, latents, labels, key):
    return mar_lib.loss_fn(model, params, latents, labels, key, train=True), ({}, model_state)

  return Task('mar', mar_cfg.img_size, mar_cfg.class_num, lambda k: (mar_lib.init_params(mar_cfg, k), {}),
              frozen, inputs, loss, _sampler(config), ('mar', 'vae'), moments)


def ecar_task(config) -> Task:
  """E-CAR: GradNorm's state is the model state, updated once per optimizer step from the stage losses
  and shared-layer gradients of the whole batch; pixel space has no tokenizer (frozen None)."""
  import ecar
  from ecar.loss import gradnorm_step, loss_and_stats, norm_taps
  cfg = ecar.ecar_config(config)
  pixel = cfg.latent_space == 'pixel'
  frozen = None if pixel else _frozen(config.vae_ckpt, 'vae', _vae_shapes, cfg.vae, config.train.seed + 1,
                                      'vae_ckpt')
  moments = None if pixel else _kl_moments(AutoencoderKL(cfg.vae))

  def inputs(frozen, batch, key):
    if 'moments' in batch:
      return _posterior_draw(batch['moments'], cfg.vae.scaling_factor, key)
    return ecar.encode_images(cfg, frozen, to_unit_range(batch['image']), key)

  def loss(params, model_state, x0, labels, key, taps=None):
    return loss_and_stats(cfg, params, model_state, x0, labels, key, taps, train=True)

  taps = None if norm_taps(cfg) is None else functools.partial(norm_taps, cfg)
  return Task('ecar', cfg.image_size, cfg.num_classes, lambda k: (ecar.init_params(cfg, k), ecar.init_gradnorm(cfg)),
              frozen, inputs, loss, _sampler(config), ('ecar', 'vae'), moments,
              update_state=functools.partial(gradnorm_step, cfg), taps=taps)


def _lpips_shapes(dtype, key):
  img = jnp.zeros((1, lpips_lib.MIN_SIZE, lpips_lib.MIN_SIZE, 3), jnp.float32)
  return lpips_lib.LPIPS(dtype).init(key, img, img)['params']


def _lpips_params(config, dtype) -> Any:
  """LPIPS from config.lpips_ckpt, else a random VGG16 whose lin weights are non-negative (as the
  released ones are), so that the random distance still grows with the difference."""
  abstract = jax.eval_shape(functools.partial(_lpips_shapes, dtype), jax.random.key(0))
  if config.lpips_ckpt:
    return checkpoint.load_component(config.lpips_ckpt, 'lpips', abstract)
  logging.warning('config.lpips_ckpt is empty: the perceptual loss is a random VGG16, not LPIPS '
                  '(python -m var_models.convert lpips writes one)')
  params = random_stand_in(abstract, config.train.seed + 1)
  return {k: jax.tree.map(np.abs, v) if k.startswith('lin') else v for k, v in params.items()}


def _adversarial(disc: PatchDiscriminator, disc_params, real: Array, fake: Array) -> dict:
  """The PatchGAN's terms, routed so that one gradient of their sum trains both networks.

  The generator's term sees the discriminator's params only through stop_gradient (it
  trains the VQVAE alone); the discriminator's term sees the reconstruction only through
  stop_gradient (it trains the discriminator alone). Real and fake go through separate
  calls, each normalised with its own batch's statistics, as VQGAN's separate forwards are.
  """
  sg = jax.lax.stop_gradient
  logits = lambda p, x: disc.apply({'params': p}, x)
  logits_real, logits_fake = logits(disc_params, real), logits(disc_params, sg(fake))
  return {'loss/generator': generator_loss(logits(sg(disc_params), fake)),
          'loss/discriminator': discriminator_hinge_loss(logits_real, logits_fake),
          'disc/logits_real': jnp.mean(logits_real), 'disc/logits_fake': jnp.mean(logits_fake)}


def vqvae_task(config) -> Task:
  """VAR's multi-scale VQVAE on the VAR paper's tokenizer loss (its eq. 5) in the VQGAN recipe:
  pixel MSE of the (straight-through) reconstruction + the quantiser's VQ loss
  + perceptual_weight x LPIPS + gate x (disc_weight x generator loss + discriminator hinge loss).

  Trained params are {'vqvae', 'disc'} (one optimizer step updates both; `_adversarial`
  routes the gradients); `frozen` is LPIPS's params (None when perceptual_weight is 0);
  the model state {'micro_steps'} counts loss evaluations (grad_accum per train step, not
  advanced by a skipped step), so gate = [micro_steps // grad_accum >= disc_start]. The
  metrics are the unweighted terms; the export is the VQVAE alone.
  """
  vq_cfg = vqvae_config(config)
  check_vqvae_loss(config, vq_cfg.image_size)
  q, dtype, accum = config.loss, compute_dtype(config.dtype), config.train.grad_accum
  vq, disc, lpips = VQVAE(vq_cfg), PatchDiscriminator(q.disc_channels, q.disc_layers, dtype), lpips_lib.LPIPS(dtype)
  perceptual = q.perceptual_weight > 0
  frozen = _lpips_params(config, dtype) if perceptual else None

  def init(key):
    k_vq, k_disc = jax.random.split(key)
    img = jnp.zeros((1, vq_cfg.image_size, vq_cfg.image_size, 3), jnp.float32)
    params = {'vqvae': _vqvae_shapes(vq_cfg, k_vq), 'disc': disc.init(k_disc, img)['params']}
    return params, {'micro_steps': jnp.zeros((), jnp.int32)}

  def inputs(frozen, batch, key):
    del key
    return to_unit_range(batch['image']), frozen  # the loss needs LPIPS's params: they ride with the images

  def loss(params, model_state, inputs, labels, key):
    del labels
    images, lpips_params = inputs
    rec, vq_loss = vq.apply({'params': params['vqvae']}, images, train=True, rngs={'dropout': key})
    rec = rec.astype(jnp.float32)
    metrics = {'loss/reconstruction': jnp.mean(jnp.square(rec - images)), 'loss/vq': vq_loss,
               'loss/perceptual': (jnp.mean(lpips.apply({'params': lpips_params}, rec, images)) if perceptual
                                   else jnp.zeros((), jnp.float32))}
    metrics.update(_adversarial(disc, params['disc'], images, rec))
    steps = model_state['micro_steps']
    gate = (steps // accum >= q.disc_start).astype(jnp.float32)
    total = (metrics['loss/reconstruction'] + vq_loss + q.perceptual_weight * metrics['loss/perceptual']
             + gate * (q.disc_weight * metrics['loss/generator'] + metrics['loss/discriminator']))
    return total, (metrics, {'micro_steps': steps + 1})

  def reconstruct(params, images):
    p = {'params': params['vqvae']}
    idx = vq.apply(p, to_unit_range(images), method=VQVAE.img_to_indices)
    return (vq.apply(p, idx, method=VQVAE.indices_to_img) + 1) * 0.5

  return Task('vqvae', vq_cfg.image_size, config.num_classes, init, frozen, inputs, loss, None, ('vqvae', None),
              reconstruct=reconstruct, export=lambda params: params['vqvae'])


BUILDERS = {'var': var_task, 'mar': mar_task, 'ecar': ecar_task, 'vqvae': vqvae_task}


def make_task(config) -> Task:
  if config.family not in BUILDERS:
    raise ValueError(f'config.family must be one of {sorted(BUILDERS)}, got {config.family!r}')
  return BUILDERS[config.family](config)
