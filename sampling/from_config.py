"""A config -> its family's sampler, call options and (for runners) parameters.

    s = sampling_from_config(config, overrides={'cfg': 2.0})   # options checked here, before compiling
    sample = s.make()                                          # or s.make(policy): an accelerator
    images, aux = sample(params, key, labels, **s.opts)

    family = family_from_config(config, ckpt)                  # the same, with the parameters
    images, aux = family.make()(family.params, key, labels, **family.opts)

`opts` are the call's keywords (`cfg` and the family's per-call options); `settings` the options a
sampler is built with (iterations, steps). Overrides name the command lines' settings (OVERRIDES);
unset ones take the config's `sample` section.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import numpy as np

from ecar.from_config import ecar_config, ecar_params
from ecar.sampler import check_sample_args as check_ecar_sample_args
from ecar.sampler import make_sampler as make_ecar_sampler
from var_models.mar.from_config import init_mar_params, load_mar_params, mar_configs
from var_models.mar.sampler import check_mar_sample_args, make_mar_sampler
from var_models.var.from_config import init_var_params, load_var_params, var_configs
from var_models.var.sampler import check_sample_args as check_var_sample_args
from var_models.var.sampler import make_sampler as make_var_sampler

Array = jax.Array

# The settings a command line may override per family: cfg (the guidance scale), top_k, top_p,
# scan_blocks (every family), num_iter, temperature, cfg_schedule, encoder_sizes, host_loop (MAR), num_steps (MAR:
# diffusion steps; E-CAR: Euler steps in all).
OVERRIDES = {'var': ('cfg', 'top_k', 'top_p', 'scan_blocks'),
             'mar': ('cfg', 'num_iter', 'temperature', 'cfg_schedule', 'num_steps', 'scan_blocks', 'encoder_sizes',
                     'host_loop'),
             'ecar': ('cfg', 'num_steps', 'scan_blocks')}
_NO_LABEL = np.zeros(1, np.int32)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How a config samples.
    name        -- 'var', 'mar' or 'ecar' (config.family): the policies it takes (accel.specs);
    num_classes -- the class count (config.num_classes);
    names       -- the keys of `params`: (model, tokenizer), e.g. ('var', 'vqvae');
    opts        -- the call's keywords (cfg and the family's per-call options);
    settings    -- the options the sampler is built with;
    make        -- policy (None: the baseline) -> sampler; a policy that does not fit fails here;
    tokens      -- aux -> per-scale token ids [[B, n_s], ...] (VAR), else None;
    load        -- (ckpt, key) -> params: from `ckpt` (a converted checkpoint or a training
                   workdir), else random (the official initialisation) drawn with `key`; in the
                   layout the samplers read (`prepare`: scanned, each list of blocks stacked).
  """
  name: str
  num_classes: int
  names: tuple[str, str]
  opts: dict
  settings: dict
  make: Callable[..., Any]
  tokens: Callable[[dict], Optional[list]]
  load: Callable[[Optional[str], Array], dict]

  @property
  def options(self) -> dict:
    """Every option, as results record them."""
    return {**self.settings, **self.opts}

  def with_params(self, params) -> 'Family':
    """This way of sampling with `params` (from `load`, or another Family's of the same model)."""
    return Family(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Sampling)}, params=params)


@dataclasses.dataclass(frozen=True)
class Family(Sampling):
  """A Sampling with its parameters {names[0]: ..., names[1]: ...}."""
  params: Any = None


def _pick(overrides: dict, key: str, default):
  return default if overrides.get(key) is None else overrides[key]


def _prepared(make: Callable[..., Any], load: Callable[[Optional[str], Array], dict]):
  """`load`, its parameters then in the layout of the family's samplers (`prepare`: scanned, the
  blocks stacked once here instead of on every call)."""
  return lambda ckpt, key: make().prepare(load(ckpt, key))


def _var(config, o: dict) -> Sampling:
  var_cfg, vq_cfg = var_configs(config)
  s = config.sample
  opts = dict(cfg=_pick(o, 'cfg', s.cfg), top_k=_pick(o, 'top_k', s.top_k), top_p=_pick(o, 'top_p', s.top_p))
  settings = dict(scan_blocks=_pick(o, 'scan_blocks', s.scan_blocks))
  check_var_sample_args(var_cfg, _NO_LABEL, **opts)
  load = lambda ckpt, key: (load_var_params(var_cfg, vq_cfg, ckpt) if ckpt else
                            init_var_params(var_cfg, vq_cfg, key))
  make = lambda policy=None: make_var_sampler(var_cfg, vq_cfg, policy, **settings)
  return Sampling('var', var_cfg.num_classes, ('var', 'vqvae'), opts, settings, make,
                  lambda aux: list(aux['indices']), _prepared(make, load))


def _mar(config, o: dict) -> Sampling:
  mar_cfg, vae_cfg = mar_configs(config)
  s = config.sample
  opts = dict(cfg=_pick(o, 'cfg', s.cfg), cfg_schedule=_pick(o, 'cfg_schedule', s.cfg_schedule),
              temperature=_pick(o, 'temperature', s.temperature))
  settings = dict(num_iter=_pick(o, 'num_iter', s.num_iter),
                  num_diffusion_steps=_pick(o, 'num_steps', s.num_diffusion_steps),
                  scan_blocks=_pick(o, 'scan_blocks', s.scan_blocks),
                  encoder_sizes=_pick(o, 'encoder_sizes', s.encoder_sizes) or None,   # 0: every position
                  host_loop=_pick(o, 'host_loop', s.host_loop))
  guided = opts['cfg'] != 1.0
  check_mar_sample_args(mar_cfg, _NO_LABEL, guided=guided, **opts)
  make = lambda policy=None: make_mar_sampler(mar_cfg, vae_cfg, guided=guided, policy=policy, **settings)
  load = lambda ckpt, key: (load_mar_params(mar_cfg, vae_cfg, ckpt) if ckpt else
                            init_mar_params(mar_cfg, vae_cfg, key))
  return Sampling('mar', mar_cfg.class_num, ('mar', 'vae'), opts, settings, make, lambda aux: None,
                  _prepared(make, load))


def _ecar(config, o: dict) -> Sampling:
  cfg = ecar_config(config)
  s = config.sample
  opts = dict(cfg=_pick(o, 'cfg', s.cfg))
  settings = dict(num_steps=_pick(o, 'num_steps', s.num_steps), scan_blocks=_pick(o, 'scan_blocks', s.scan_blocks))
  check_ecar_sample_args(cfg, _NO_LABEL, **opts)
  make = lambda policy=None: make_ecar_sampler(cfg, policy=policy, **settings)
  load = lambda ckpt, key: ecar_params(cfg, ckpt, config.vae_ckpt, key)
  return Sampling('ecar', cfg.num_classes, ('ecar', 'vae'), opts, settings, make, lambda aux: None,
                  _prepared(make, load))


_BUILDERS = {'var': _var, 'mar': _mar, 'ecar': _ecar}


def sampling_from_config(config, overrides: Optional[dict] = None) -> Sampling:
  """The Sampling of a configs/{var,mar,ecar}.py config; `overrides` {setting: value or None} of
  OVERRIDES[config.family]. Every option is checked here; an error names it."""
  if config.family not in _BUILDERS:
    raise ValueError(f'config.family must be one of {sorted(_BUILDERS)}, got {config.family!r}')
  overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
  wrong = sorted(set(overrides) - set(OVERRIDES[config.family]))
  if wrong:
    raise ValueError(f'{wrong} do not apply to config.family={config.family!r} (it takes '
                     f'{list(OVERRIDES[config.family])})')
  try:
    return _BUILDERS[config.family](config, overrides)
  except ValueError as e:
    raise ValueError(f'bad config.sample (or its command-line override): {e}') from e


def family_from_config(config, ckpt: Optional[str] = None, overrides: Optional[dict] = None,
                       key: Optional[Array] = None) -> Family:
  """`sampling_from_config(config, overrides)` with the parameters of `ckpt` (None: random weights,
  drawn with `key`, default key(0))."""
  s = sampling_from_config(config, overrides)
  return s.with_params(s.load(ckpt, jax.random.key(0) if key is None else key))
