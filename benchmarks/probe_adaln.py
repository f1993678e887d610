import jax, jax.numpy as jnp, numpy as np
import pallas_kernels as pk
from timing import print_top_device_ops
depth, width, steps, m = 12, 1536, 20, 16
dt = jnp.bfloat16
k = iter(jax.random.split(jax.random.key(0), 200))
n = lambda s, sc=1.0: (sc * jax.random.normal(next(k), s)).astype(dt)
blocks = [((1 + n((width,), .1), n((width,), .1)), (n((width, width), width ** -.5), n((width,), .1), n((width, width), width ** -.5), n((width,), .1))) for _ in range(depth)]
mods = [n((3, m, width), .3) for _ in range(depth)]
x = n((m, width))
for impl in ('reference', 'triton'):
  def f(x, blocks, mods):
    def step(_, h):
      for (ln, mlp), (s, c, g) in zip(blocks, mods):
        h = pk.adaln_mlp(h, s, c, g, ln, mlp, impl=impl)
      return h
    return jax.lax.fori_loop(0, steps, step, x)
  fn = jax.jit(f)
  jax.block_until_ready(fn(x, blocks, mods))
  print(impl, flush=True)
  print_top_device_ops(lambda: jax.block_until_ready(fn(x, blocks, mods)), f'/tmp/prof_{impl}', top=12)
