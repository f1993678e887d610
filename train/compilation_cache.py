"""JAX's persistent compilation cache for the command-line programs.

A program compiled once (a train step, a sampler) is stored under the cache folder and loaded
by every later run of the same program on the same devices and jax version: a resumed run
starts in seconds instead of recompiling for minutes. On many hosts only process 0 writes
entries (JAX's rule), and every host reads them when the folder is shared (a home or project
directory on the cluster's file system); a host that cannot see it compiles for itself.
"""
from __future__ import annotations

import os

import jax
from absl import flags, logging

DEFAULT_DIR = os.path.join(os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'ecar_jax', 'xla')

COMPILATION_CACHE = flags.DEFINE_string(
    'compilation_cache', DEFAULT_DIR, 'folder of the persistent compilation cache (compiled programs reused '
    'by later runs); empty: off. JAX_ENABLE_COMPILATION_CACHE=false also turns it off')


def enable(path: str) -> None:
  """Caches every compilation of at least a second under `path` ('' leaves caching off)."""
  if not path:
    return
  os.makedirs(path, exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)
  logging.info('persistent compilation cache: %s', path)
