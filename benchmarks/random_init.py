"""Drawing a model's random parameters: compile and run time of its initialiser as one program, with
XLA's threefry rounds and with threefry kernels (`var_models.nn.init.compiled_init`), and whether
the two draw the same bits.

  python3 benchmarks/random_init.py --models mar:huge,mar:base,ecar:L,var:d30 --compilation_cache=
  python benchmarks/random_init.py --models mar:tiny,ecar:tiny       # on a CPU (threefry is a loop there)

A model is FAMILY:VARIANT of configs/FAMILY.py. Its initialiser is what `sampling`'s loaders call
without a checkpoint ({'var', 'vqvae'}, {'mar', 'vae'}, {'ecar', 'vae'}), jitted whole: outside
`threefry_kernels` it lowers XLA's rounds (as a train state split over FSDP is drawn), inside it the
kernels. Each program is compiled and called twice; the time of the second call is its run time.
"""
from __future__ import annotations

import argparse
import importlib
import time

import jax
import numpy as np

from ecar.from_config import ecar_config, ecar_params
from sampling import compilation_cache
from var_models.mar.from_config import init_mar_params, mar_configs
from var_models.nn.init import threefry_kernels
from var_models.var.from_config import init_var_params, var_configs

INITS = {
    'var': lambda config, key: init_var_params(*var_configs(config), key),
    'mar': lambda config, key: init_mar_params(*mar_configs(config), key),
    'ecar': lambda config, key: ecar_params(ecar_config(config), None, None, key),
}


def model_init(spec: str):
  """'FAMILY:VARIANT' -> key -> random parameters of configs/FAMILY.py:VARIANT (attention on XLA's
  backend, which no parameter depends on, so that a CPU lowers it too)."""
  family, _, variant = spec.partition(':')
  if family not in INITS or not variant:
    raise ValueError(f'--models: {spec!r} is not FAMILY:VARIANT with FAMILY one of {sorted(INITS)}')
  config = importlib.import_module(f'configs.{family}').get_config(variant)
  config.attn_backend = 'xla'
  return lambda key: INITS[family](config, key)


def compile_and_run(init, key) -> tuple[float, float, object]:
  """(compile s, run s of a second call, parameters) of jit(init) lowered under the current settings."""
  t0 = time.perf_counter()
  compiled = jax.jit(init).lower(key).compile()
  t1 = time.perf_counter()
  params = jax.block_until_ready(compiled(key))
  t2 = time.perf_counter()
  jax.block_until_ready(compiled(key))
  return t1 - t0, time.perf_counter() - t2, params


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--models', default='mar:huge,ecar:L', help='FAMILY:VARIANT,... of configs/')
  args = compilation_cache.parse_args(ap)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}', flush=True)
  inits = {spec: model_init(spec) for spec in args.models.split(',')}
  key = jax.random.key(0)
  for spec, init in inits.items():
    with threefry_kernels():
      k_compile, k_run, kernels = compile_and_run(init, key)
    r_compile, r_run, rounds = compile_and_run(init, key)
    equal = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(kernels), jax.tree.leaves(rounds)))
    count = sum(a.size for a in jax.tree.leaves(rounds))
    print(f'{spec:12} {count / 1e6:8.1f}M parameters, {len(jax.tree.leaves(rounds))} arrays: XLA rounds compile '
          f'{r_compile:6.1f} s, run {1e3 * r_run:7.1f} ms; threefry kernels compile {k_compile:5.1f} s, '
          f'run {1e3 * k_run:7.1f} ms; same bits: {equal}', flush=True)


if __name__ == '__main__':
  main()
