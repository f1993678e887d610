"""The flags the sampling CLIs share (`python -m train.sample`, `python -m train.evaluate`,
`python -m accel.compare`): the config, the checkpoint, the seed, the batch and each family's
sampling settings, with their checks. Importing this module defines them.
"""
from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from var_models import checkpoint

CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/{var,mar,ecar}.py:VARIANT', lock_config=True)
CKPT = flags.DEFINE_string('ckpt', None, 'checkpoint directory (from `python -m var_models.convert`) or '
                           'training workdir (`python -m train`)')
SEED = flags.DEFINE_integer('seed', None, 'random seed')
BATCH = flags.DEFINE_integer('batch_size', None, 'images per compiled call (default: config.sample.batch_size; '
                            'accel.compare: 1)')
TOP_K = flags.DEFINE_integer('top_k', None, 'VAR: top-k, 0 = off')
TOP_P = flags.DEFINE_float('top_p', None, 'VAR: top-p in (0, 1], 1 = off')
SCAN = flags.DEFINE_bool('scan_blocks', None, "runs of alike blocks as one lax.scan (VAR: per scale; MAR: "
                         "the encoder and the decoder; E-CAR: the AR and each denoiser); compiles once per run, not per "
                         'block; benchmarks/RESULTS.md has its run time')
NUM_ITER = flags.DEFINE_integer('num_iter', None, 'MAR: iterations')
TEMP = flags.DEFINE_float('temperature', None, 'MAR: diffusion temperature')
SCHEDULE = flags.DEFINE_string('cfg_schedule', None, "MAR: 'linear' or 'constant'")
STEPS = flags.DEFINE_integer('num_diffusion_steps', None, 'MAR: diffusion steps')
EULER = flags.DEFINE_integer('num_steps', None, 'E-CAR: Euler steps in all, split over the stages')
ENCODER_SIZES = flags.DEFINE_integer('encoder_sizes', None, "MAR: the encoder's lengths compiled, the known "
                                     'positions padded into at most this many (0: every position, one length)')

HOST_LOOP = flags.DEFINE_bool('host_loop', None, "MAR: the iterations driven from the host, a program per "
                              'distinct iteration body scanning consecutive alike iterations, compiled side by side')

_FAMILY_FLAGS = {'var': (TOP_K, TOP_P, SCAN),
                 'mar': (NUM_ITER, TEMP, SCHEDULE, STEPS, SCAN, ENCODER_SIZES, HOST_LOOP),
                 'ecar': (EULER, SCAN)}
FAMILY_NAMES = {'var': 'VAR', 'mar': 'MAR', 'ecar': 'E-CAR'}


def pick(flag, default):
  return default if flag.value is None else flag.value


def integers(flag) -> list[int]:
  """A list flag's values as integers (e.g. --labels), or an error naming the flag."""
  try:
    return [int(x) for x in flag.value]
  except ValueError:
    raise ValueError(f'--{flag.name} must be integers, got {flag.value}') from None


def check_family(config) -> None:
  """The config's family is known, no flag of another family is set, and --ckpt (if any) holds this family."""
  family = config.family
  if family not in _FAMILY_FLAGS:
    raise ValueError(f'config.family must be one of {sorted(_FAMILY_FLAGS)}, got {family!r}')
  own = {f.name for f in _FAMILY_FLAGS[family]}
  for other, fl in _FAMILY_FLAGS.items():
    for f in fl if other != family else ():
      if f.value is not None and f.name not in own:
        where = ' and '.join(FAMILY_NAMES[o] for o, g in _FAMILY_FLAGS.items() if f.name in {h.name for h in g})
        raise ValueError(f'--{f.name} applies to {where} configs, not to config.family={family!r}')
  if CKPT.value:
    stored = checkpoint.load_meta(CKPT.value).get('family', family)
    if stored != family:
      raise ValueError(f'--ckpt {CKPT.value} holds {FAMILY_NAMES.get(stored, stored)} params (its meta.json), '
                       f'not config.family={family!r}')


def overrides(family: str, cfg) -> dict:
  """The sampling flags given and guidance scale `cfg`, as `sampling.family_from_config` overrides."""
  steps = STEPS if family == 'mar' else EULER
  return dict(cfg=cfg, top_k=TOP_K.value, top_p=TOP_P.value, scan_blocks=SCAN.value, num_iter=NUM_ITER.value,
              temperature=TEMP.value, cfg_schedule=SCHEDULE.value, num_steps=steps.value,
              encoder_sizes=ENCODER_SIZES.value, host_loop=HOST_LOOP.value)


def batch_size(default: int) -> int:
  batch = pick(BATCH, default)
  if batch <= 0:
    raise ValueError(f'--batch_size must be positive, got {batch}')
  return batch
