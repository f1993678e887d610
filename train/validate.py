"""Checks of `config.train` and `config.data` at start-up; every error names its key."""
from __future__ import annotations

import math

from train.data.transforms import CROPS
from train.optimizer import SCHEDULES
from var_models.tokenizers.lpips import MIN_SIZE as LPIPS_MIN_SIZE
from var_models.tokenizers.patch_discriminator import patch_grid

SOURCES = ('synthetic', 'folder', 'imagenet')


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(cond: bool, key: str, value, want: str) -> None:
  if not cond:
    raise ValueError(f'config.{key} must be {want}, got {value!r}')


def _ints(section, prefix: str, minimum: int, keys) -> None:
  for k in keys:
    v = section[k]
    _check(_is_int(v) and v >= minimum, f'{prefix}.{k}', v, f'an integer >= {minimum}')


def _fraction(section, prefix: str, key: str, high_open: bool = False) -> None:
  v = section[key]
  ok = _is_num(v) and 0 <= v and (v < 1 if high_open else v <= 1)
  _check(ok, f'{prefix}.{key}', v, 'in [0, 1)' if high_open else 'in [0, 1]')


def check_train(t) -> None:
  _ints(t, 'train', 1, ('steps', 'batch_size', 'grad_accum', 'log_every', 'ckpt_every', 'keep_checkpoints',
                         'sample_every', 'max_bad_steps'))
  _ints(t, 'train', 0, ('warmup_steps', 'seed', 'sample_per_class', 'sample_classes', 'sample_seed',
                         'sample_metrics'))
  _check(t.batch_size % t.grad_accum == 0, 'train.batch_size', t.batch_size,
         f'a multiple of config.train.grad_accum={t.grad_accum}')
  _check(t.optimizer == 'adamw', 'train.optimizer', t.optimizer, "'adamw'")
  _check(t.schedule in SCHEDULES, 'train.schedule', t.schedule, f'one of {SCHEDULES}')
  _check(_is_num(t.lr) and t.lr > 0, 'train.lr', t.lr, 'a positive number')
  _check(_is_num(t.eps) and t.eps > 0, 'train.eps', t.eps, 'a positive number')
  for k in ('weight_decay', 'grad_clip', 'peak_flops'):
    _check(_is_num(t[k]) and t[k] >= 0, f'train.{k}', t[k], 'a number >= 0')
  for k in ('b1', 'b2', 'ema_decay'):
    _fraction(t, 'train', k, high_open=True)
  for k in ('warmup_init', 'end_lr_fraction'):
    _fraction(t, 'train', k)
  _check(all(isinstance(n, str) for n in t.no_decay), 'train.no_decay', t.no_decay, 'a tuple of names')
  _check(_is_int(t.mesh_fsdp) and t.mesh_fsdp >= 1, 'train.mesh_fsdp', t.mesh_fsdp, 'an integer >= 1')
  _check(_is_int(t.mesh_data) and (t.mesh_data >= 1 or t.mesh_data == -1), 'train.mesh_data', t.mesh_data,
         'an integer >= 1, or -1 (all devices left)')


def check_data(d, family: str) -> None:
  _check(d.source in SOURCES, 'data.source', d.source, f'one of {SOURCES}')
  _check(d.crop in CROPS, 'data.crop', d.crop, f'one of {CROPS}')
  _ints(d, 'data', 1, ('num_examples', 'threads'))
  _ints(d, 'data', 0, ('workers',))
  _check(isinstance(d.hflip, bool), 'data.hflip', d.hflip, 'True or False')
  if d.source == 'folder':
    _check(bool(d.path), 'data.path', d.path, 'the image folder (one sub-folder per class)')
  _check(not d.cache_latents or family in ('mar', 'ecar'), 'data.cache_latents', d.cache_latents,
         'False for this family (MAR and E-CAR on VAE latents train on cached latents)')


def check_vqvae_loss(config, image_size: int) -> None:
  """config.loss and config.lpips_ckpt of a configs/var.py vqvae config (the tokenizer's task checks it)."""
  if 'loss' not in config:
    raise ValueError('config has no `loss` section (configs/var.py:vqvae sets perceptual_weight, disc_weight, '
                     'disc_start, disc_channels, disc_layers)')
  q = config.loss
  for k in ('perceptual_weight', 'disc_weight'):
    _check(_is_num(q[k]) and q[k] >= 0, f'loss.{k}', q[k], 'a number >= 0')
  _ints(q, 'loss', 0, ('disc_start',))
  _ints(q, 'loss', 1, ('disc_channels', 'disc_layers'))
  if patch_grid(image_size, q.disc_layers) < 1:
    raise ValueError(f'config.loss.disc_layers={q.disc_layers} leaves the discriminator no output for '
                     f'{image_size} px images (it needs >= {3 * 2 ** q.disc_layers} px)')
  _check(isinstance(config.lpips_ckpt, str), 'lpips_ckpt', config.lpips_ckpt, 'a directory path or empty')
  if q.perceptual_weight > 0 and image_size < LPIPS_MIN_SIZE:
    raise ValueError(f'config.loss.perceptual_weight={q.perceptual_weight} needs images of at least '
                     f'{LPIPS_MIN_SIZE} px (LPIPS VGG16), got image_size {image_size}; set it to 0')


def check_config(config) -> None:
  """Validates the sections the trainer reads (the model sections are checked by their builders)."""
  for section in ('train', 'data'):
    if section not in config:
      raise ValueError(f'config has no `{section}` section (configs.common.{section}_config())')
  check_train(config.train)
  check_data(config.data, config.get('family'))
