"""The three samplers behind one interface, for runners that compare or time policies on any of them
(`python -m accel.compare`): an ml_collections config (configs/{var,mar,ecar}.py) and a checkpoint -> `Family`.
`python -m train.sample` samples through it too.

    family = family_from_config(config, ckpt, overrides)
    sample = family.make(policy_from_spec('lazymar:official', family.name))
    args, kwargs = family.call(key, labels)
    images, aux = sample(*args, **kwargs)    # or sample.lower(*args, **kwargs).compile()(*sample.arguments(...))
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import numpy as np

from ecar.from_config import ecar_config, ecar_params
from ecar.sampler import make_sampler as make_ecar_sampler
from var_models.mar.from_config import init_mar_params, load_mar_params, mar_configs
from var_models.mar.sampler import check_mar_sample_args, make_mar_sampler
from var_models.var.from_config import init_var_params, load_var_params, var_configs
from var_models.var.sampler import check_sample_args, make_sampler as make_var_sampler

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Family:
  """One model and its sampling settings.
    name     -- 'var', 'mar' or 'ecar' (config.family): the policies it takes (accel.specs);
    opts     -- the sampling settings, as the sampler's keywords (recorded with the results);
    make     -- policy -> sampler; a policy that does not fit the model fails here, before compiling;
    call     -- (key, labels [B]) -> (args, kwargs) of a sampler call with these params and opts;
    tokens   -- aux -> per-scale token ids [[B, n_s], ...] (VAR), else None.
  """
  name: str
  num_classes: int
  params: Any
  opts: dict
  make: Callable[[Any], Any]
  call: Callable[[Array, np.ndarray], tuple[tuple, dict]]
  tokens: Callable[[dict], Optional[list]]


def _pick(overrides: dict, key: str, default):
  return default if overrides.get(key) is None else overrides[key]


def _var(config, ckpt: Optional[str], overrides: dict, key: Array) -> Family:
  var_cfg, vq_cfg = var_configs(config)
  s = config.sample
  opts = dict(cfg=_pick(overrides, 'cfg', s.cfg), top_k=_pick(overrides, 'top_k', s.top_k),
              top_p=_pick(overrides, 'top_p', s.top_p))
  check_sample_args(var_cfg, np.zeros(1, np.int32), **opts)
  params = (load_var_params(var_cfg, vq_cfg, ckpt) if ckpt else init_var_params(var_cfg, vq_cfg, key))
  return Family('var', var_cfg.num_classes, params, opts, lambda policy: make_var_sampler(var_cfg, vq_cfg, policy),
                lambda key, labels: ((params, key, labels), opts), lambda aux: list(aux['indices']))


def _mar(config, ckpt: Optional[str], overrides: dict, key: Array) -> Family:
  mar_cfg, vae_cfg = mar_configs(config)
  s = config.sample
  opts = dict(cfg=_pick(overrides, 'cfg', s.cfg), cfg_schedule=_pick(overrides, 'cfg_schedule', s.cfg_schedule),
              temperature=_pick(overrides, 'temperature', s.temperature))
  num_iter, steps = _pick(overrides, 'num_iter', s.num_iter), _pick(overrides, 'num_steps', s.num_diffusion_steps)
  guided = opts['cfg'] != 1.0
  check_mar_sample_args(mar_cfg, np.zeros(1, np.int32), opts['cfg'], guided, opts['cfg_schedule'],
                        opts['temperature'])
  params = (load_mar_params(mar_cfg, vae_cfg, ckpt) if ckpt else init_mar_params(mar_cfg, vae_cfg, key))
  make = lambda policy: make_mar_sampler(mar_cfg, vae_cfg, num_iter=num_iter, guided=guided,
                                         num_diffusion_steps=steps, policy=policy)
  return Family('mar', mar_cfg.class_num, params, dict(opts, num_iter=num_iter, num_diffusion_steps=steps), make,
                lambda key, labels: ((params, key, labels), opts), lambda aux: None)


def _ecar(config, ckpt: Optional[str], overrides: dict, key: Array) -> Family:
  cfg = ecar_config(config)
  s = config.sample
  cfg_scale, steps = _pick(overrides, 'cfg', s.cfg_scale), _pick(overrides, 'num_steps', s.num_steps)
  if not np.isfinite(cfg_scale):
    raise ValueError(f'--cfg must be finite, got {cfg_scale}')
  params = ecar_params(cfg, ckpt, config.vae_ckpt, key)
  make = lambda policy: make_ecar_sampler(cfg, num_steps=steps, policy=policy)
  return Family('ecar', cfg.num_classes, params, dict(cfg_scale=cfg_scale, num_steps=steps), make,
                lambda key, labels: ((params['ecar'], params['vae'], key, labels), dict(cfg_scale=cfg_scale)),
                lambda aux: None)


BUILDERS = {'var': _var, 'mar': _mar, 'ecar': _ecar}
# The sampling settings each family lets a runner override: cfg (VAR, MAR: cfg; E-CAR: cfg_scale),
# top_k, top_p (VAR), num_iter, temperature, cfg_schedule (MAR), num_steps (MAR: diffusion steps;
# E-CAR: Euler steps in all).
OVERRIDES = {'var': ('cfg', 'top_k', 'top_p'), 'mar': ('cfg', 'num_iter', 'temperature', 'cfg_schedule', 'num_steps'),
             'ecar': ('cfg', 'num_steps')}


def family_from_config(config, ckpt: Optional[str] = None, overrides: Optional[dict] = None,
                       key: Optional[Array] = None) -> Family:
  """The Family of a configs/{var,mar,ecar}.py config; `ckpt` a converted checkpoint or a training
  workdir (None: random weights, drawn with `key`, default key(0)); `overrides` {setting: value or
  None} of OVERRIDES[config.family]."""
  if config.family not in BUILDERS:
    raise ValueError(f'config.family must be one of {sorted(BUILDERS)}, got {config.family!r}')
  overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
  wrong = sorted(set(overrides) - set(OVERRIDES[config.family]))
  if wrong:
    raise ValueError(f'{wrong} do not apply to config.family={config.family!r} (it takes '
                     f'{list(OVERRIDES[config.family])})')
  return BUILDERS[config.family](config, ckpt, overrides, jax.random.key(0) if key is None else key)
