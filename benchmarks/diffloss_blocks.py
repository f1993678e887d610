"""MAR-H's 12 DiffLoss res blocks on a few rows: the persistent Mosaic GPU kernel
(`pallas_kernels.diffloss_blocks_mgpu`) against its float32 reference and XLA (Hopper only).

    python3 benchmarks/diffloss_blocks.py 8,16           # rows; PROFILE=1 adds a device profile

Per row count: the kernel's first call (compile included), its relative L2 error against the
float32 reference beside that of XLA's bf16 blocks, whether two calls agree bit for bit, and
us per step of a 100-step `fori_loop` (each step the 12 blocks, then h * 0.5 + x), medians of 10
loops. The XLA column runs flax's `ResBlock`s in bf16 with each block's weights a separate array,
as MAR's head runs them.
"""
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from accel.timing import timed_calls
from pallas_kernels import reference
from pallas_kernels.diffloss_blocks_mgpu import diffloss_blocks as _blocks
from var_models.mar.diffloss import ResBlock


def diffloss_blocks(*a):
  """The kernel as UNROLL (0: a loop over each call's blocks) and GROUP (blocks a call) say."""
  return _blocks(*a, unroll=bool(int(os.environ.get('UNROLL', '0'))),
                 blocks_per_call=int(os.environ.get('GROUP', '0')) or None)


def block_params(w1, b1, w2, b2, g, be):
  """Each block's flax parameters, separate arrays: Dense weights in bf16, LayerNorm in float32."""
  bf16 = lambda a: jnp.array(a, jnp.bfloat16)
  return [{'in_ln': {'scale': jnp.array(g[i]), 'bias': jnp.array(be[i])},
           'mlp_0': {'kernel': bf16(w1[i]), 'bias': bf16(b1[i])},
           'mlp_2': {'kernel': bf16(w2[i]), 'bias': bf16(b2[i])}} for i in range(w1.shape[0])]


def xla_blocks(x, mods, params):
  """The blocks as MAR's head runs them: flax's `ResBlock` in bf16."""
  c = x.shape[-1]
  for i, p in enumerate(params):
    x = ResBlock(c, dtype=jnp.bfloat16).apply({'params': p}, x, None, mods[:, 3 * i * c:3 * (i + 1) * c])
  return x


def loop(fn, steps):
  @jax.jit
  def run(x, *rest):
    def body(i, h):
      return fn(h, *rest) * 0.5 + x
    return lax.fori_loop(0, steps, body, x)
  return run


def timed(f, *a, iters=10):
  """Median seconds of f(*a) over `iters` calls after one."""
  return float(np.median([s for _, s in timed_calls(f, [a] * (iters + 1), warmup=1)]))


def main():
  c, d = 1536, 12

  rows = [int(v) for v in sys.argv[1].split(',')]
  for r in rows:
    a = tuple(v.astype(jnp.bfloat16) if i < 2 else v
              for i, v in enumerate(reference.diffloss_blocks_inputs(r, c, d)))
    xa = (a[0], a[1], block_params(*a[2:]))
    t0 = time.perf_counter()
    got = jax.block_until_ready(diffloss_blocks(*a))
    print(f'rows {r}: first call {time.perf_counter() - t0:.1f} s', flush=True)
    want = reference.diffloss_blocks(*a)
    xla = xla_blocks(*xa)
    rel = lambda u: float(jnp.linalg.norm(u.astype(jnp.float32) - want.astype(jnp.float32)) /
                          jnp.linalg.norm(want.astype(jnp.float32)))
    print(f'  rel L2 vs float32 reference: kernel {rel(got):.2e}, XLA bf16 {rel(xla):.2e}; '
          f'max |kernel - ref| {float(jnp.abs(got.astype(jnp.float32) - want).max()):.3e}', flush=True)
    again = jax.block_until_ready(diffloss_blocks(*a))
    print(f'  run to run equal: {bool((again == got).all())}', flush=True)
    steps = 100
    tk = timed(loop(diffloss_blocks, steps), *a)
    tx = timed(loop(xla_blocks, steps), *xa)
    print(f'  {steps} steps: kernel {tk / steps * 1e6:.1f} us / step, XLA {tx / steps * 1e6:.1f} us / step',
          flush=True)
    if os.environ.get('PROFILE'):
      import timing
      for name, f, args in (('kernel', loop(diffloss_blocks, 10), a), ('xla', loop(xla_blocks, 10), xa)):
        print(f'  [{name}] a 10-step loop:', flush=True)
        timing.print_top_device_ops(lambda: jax.block_until_ready(f(*args)), f'/tmp/pdb_{name}_{r}', 8)

if __name__ == '__main__':
  main()
