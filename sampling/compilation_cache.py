"""JAX's persistent compilation cache for every command line (`python -m train`, `train.sample`,
`train.evaluate`, `accel.compare`, the benchmarks).

A program compiled once (a train step, a sampler) is stored under the cache folder and loaded by
every later run of the same program on the same devices and jax version: a second run starts in
seconds instead of recompiling for minutes. Several processes may share the folder: entries are
written whole under their key, and on many hosts only process 0 writes (JAX's rule) while every
host reads them when the folder is shared (a home or project directory on the cluster's file
system); a host that cannot see it compiles for itself.

Each command's `--compilation_cache` names the folder, by default $JAX_COMPILATION_CACHE_DIR, else
~/.cache/ecar_jax/xla; an empty value turns it off, as does JAX_ENABLE_COMPILATION_CACHE=false.
"""
from __future__ import annotations

import argparse
import os

import jax
from absl import flags, logging

DEFAULT_DIR = (os.environ.get('JAX_COMPILATION_CACHE_DIR') or
               os.path.join(os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'ecar_jax', 'xla'))
_HELP = 'folder of the persistent compilation cache (compiled programs reused by later runs); empty: off'

COMPILATION_CACHE = flags.DEFINE_string('compilation_cache', DEFAULT_DIR, _HELP)


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
  """An argparse command line's arguments (the benchmarks'), its --compilation_cache added and enabled.

  A benchmark's compile times are of loads from the cache for programs compiled before: it says so,
  and --compilation_cache= measures cold compiles."""
  parser.add_argument('--compilation_cache', default=DEFAULT_DIR, help=_HELP)
  args = parser.parse_args()
  enable(args.compilation_cache)
  if args.compilation_cache:
    print(f'persistent compilation cache: {args.compilation_cache} (a program compiled before loads from it: '
          'compile times of cold compiles need --compilation_cache=)', flush=True)
  return args


def enable(path: str) -> None:
  """Caches every compilation of at least a second under `path` ('' leaves caching off)."""
  if not path:
    return
  os.makedirs(path, exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)
  logging.info('persistent compilation cache: %s', path)
