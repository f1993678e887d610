"""MAR-H's 12 DiffLoss res blocks on a few rows: the persistent Mosaic GPU kernel
(`pallas_kernels.diffloss_blocks_mgpu`) against its float32 reference and XLA (Hopper only).

    python3 benchmarks/diffloss_blocks.py 8,16,28        # rows; PROFILE=1 adds a device profile

Per row count: the kernel's first call (compile included), its relative L2 error against the
float32 reference beside that of XLA's bf16 blocks, whether two calls agree bit for bit, and
us per step of a 100-step `fori_loop` (each step the 12 blocks, then h * 0.5 + x), medians of 10
loops. The XLA column slices each block's weights out of the [12, C, C] stacks the kernel takes,
and XLA copies them out of the stack at every step (MemcpyD2D in the profile): it is slower than
the head's own path (separate weights per block, ~12 us a block at 8 rows, RESULTS.md "MAR-H's
head step at batch 1, profiled").
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
from pallas_kernels.diffloss_blocks_mgpu import diffloss_blocks


def inputs(r, c, d, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 9)
  n = lambda k, s, sc: (jax.random.normal(k, s, jnp.float32) * sc)
  return (n(ks[0], (r, c), 1.0).astype(jnp.bfloat16), n(ks[1], (r, 3 * d * c + 2 * c), 0.3).astype(jnp.bfloat16),
          n(ks[2], (d, c, c), c ** -0.5).astype(jnp.bfloat16), n(ks[3], (d, c), 0.1),
          n(ks[4], (d, c, c), c ** -0.5).astype(jnp.bfloat16), n(ks[5], (d, c), 0.1),
          1.0 + n(ks[6], (d, c), 0.1), n(ks[7], (d, c), 0.1))


def xla_blocks(x, mods, w1, b1, w2, b2, g, be):
  """The blocks in bf16 as flax's `ResBlock` computes them, weights sliced from the stacks."""
  c = x.shape[-1]
  h = x
  for i in range(w1.shape[0]):
    shift, scale, gate = jnp.split(mods[:, 3 * i * c:3 * (i + 1) * c], 3, axis=-1)
    hf = h.astype(jnp.float32)
    mean = hf.mean(-1, keepdims=True)
    var = ((hf - mean) ** 2).mean(-1, keepdims=True)
    y = ((hf - mean) * lax.rsqrt(var + 1e-6) * g[i] + be[i]).astype(jnp.bfloat16)
    y = y * (1 + scale) + shift
    y = jax.nn.silu(y @ w1[i] + b1[i].astype(jnp.bfloat16)) @ w2[i] + b2[i].astype(jnp.bfloat16)
    h = h + gate * y
  return h


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
    a = inputs(r, c, d)
    t0 = time.perf_counter()
    got = jax.block_until_ready(diffloss_blocks(*a))
    print(f'rows {r}: first call {time.perf_counter() - t0:.1f} s', flush=True)
    want = reference.diffloss_blocks(*a)
    xla = xla_blocks(*a)
    rel = lambda u: float(jnp.linalg.norm(u.astype(jnp.float32) - want.astype(jnp.float32)) /
                          jnp.linalg.norm(want.astype(jnp.float32)))
    print(f'  rel L2 vs float32 reference: kernel {rel(got):.2e}, XLA bf16 {rel(xla):.2e}; '
          f'max |kernel - ref| {float(jnp.abs(got.astype(jnp.float32) - want).max()):.3e}', flush=True)
    again = jax.block_until_ready(diffloss_blocks(*a))
    print(f'  run to run equal: {bool((again == got).all())}', flush=True)
    steps = 100
    tk = timed(loop(diffloss_blocks, steps), *a)
    tx = timed(loop(xla_blocks, steps), *a)
    print(f'  {steps} steps: kernel {tk / steps * 1e6:.1f} us / step, XLA {tx / steps * 1e6:.1f} us / step',
          flush=True)
    if os.environ.get('PROFILE'):
      import timing
      for name, f in (('kernel', loop(diffloss_blocks, 10)), ('xla', loop(xla_blocks, 10))):
        ops, busy = timing.top_device_ops(lambda: jax.block_until_ready(f(*a)), f'/tmp/pdb_{name}_{r}', 6)
        print(f'  [{name}] busy {busy}; ' + '; '.join(f'{n[:50]} x{k} {ms * 1e3 / k:.2f} us' for _, n, ms, k in ops),
              flush=True)


if __name__ == '__main__':
  main()
