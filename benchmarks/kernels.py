"""Kernel benchmarks of pallas_kernels, side by side in one run.

(a) SparVAR's Table 1 shape (bf16, q 4096, kv 10521, head dim 128, 24 heads):
    the CSLA layout (sinks: scales <= 5; windows 3, 5, 7 on the last three
    scales; 128-token tiles) against cuDNN without a mask and our kernels with
    the dense layout; achieved fraction of the ideal speedup 1 / density. The
    Mosaic GPU forward (Hopper) reads keys from a buffer of 10528 rows (TMA
    needs a multiple of 8, as a KV cache with spare rows gives it); the layout
    attends the same 10521.
(b) Scale-causal training attention, forward and forward+backward, at VAR-d16
    256 px (L 680) and the 13-scale 1024 px schedule (L 10521), against cuDNN
    with the explicit mask and XLA. 'pallas' is the Triton lowering; 'pallas
    mosaic' the Mosaic GPU kernels (Hopper), which pad lengths to a multiple of
    8 themselves (at L 10521 a copy of q, k, v to 10528 rows, in the time).
(c) Top-k gather/scatter on FastVAR's Infinity-2B shapes (width 2048, the 32x32
    and 40x40 scales) against lax.top_k + take_along_axis + scatter in XLA,
    with bandwidth against the measured device copy bandwidth.
(d) Gathered-key attention (SparVAR's CS4A) on the last scale: each group of 192
    queries attends to its own n keys (top 20 % of the decision scale's keys plus
    the sinks; here random distinct positions, sorted), at Infinity-2B 1024 px
    and VAR-d30 256 px, against cuDNN dense attention on the same q, k, v, with
    the achieved fraction of the floor of the gathered work.
(e) Column sums per query group (SparVAR's CS4A decision scale, Infinity-2B 1024 px:
    q 1600, the 4121 keys of a 10521-row KV buffer, group 192): the plain-jnp
    computation (materialised logits and probabilities), the
    dense flash forward with lse, the column-sum kernel given that lse (block_k /
    num_warps variants) and both together, against cuDNN dense attention on the
    same q, k, v, with the kernel's fraction of its floor.
(f) Top-k selection (SparVAR's CS4A: the 824 of 4121 keys with the largest column sums,
    per (batch row, head, query group) of the Infinity-2B and -8B decision scales):
    `pk.top_k_indices` (a set, in index order) against lax.top_k (XLA sorts each row),
    exact set equality, bandwidth against the device copy.
(g) A dense layer of weights stacked on a layer axis (a scanned block's) at Infinity-2B's four
    shapes (or --layer_dense_shapes), 2-128 rows and 32 layers in a loop (or --layer_dense_rows,
    --layer_dense_depth; --layer_dense_unroll layers an iteration): `pk.layer_dense` (its Triton
    kernel; on Hopper its Mosaic GPU kernel too, with --layer_dense_mosaic_configs' tilings) against
    XLA's GEMM of the copied slice and of separate weights, against the floor (the weights read
    once, or the FLOPs at the peak where those take longer).
(h) Attention over a few hundred tokens at MAR-H's trunk shapes (--few_token_shapes: the
    refreshes' both CFG halves over 320 tokens, a cached iteration's decoder and encoder; 16 heads
    of 80), unmasked (the decoder) and under a per-sample key mask (the encoder), as a chain of
    --few_token_chain calls in one program (a trunk's 40): `pk.few_token_attention` at each of
    --few_token_configs' tilings against cuDNN's call (a memset and the attention kernel), per call.

Every kernel is first checked against a float32 XLA computation on the same
bf16 inputs (relative L2 error). Times: medians over repetitions of many
back-to-back calls (inputs rotated beyond L2) after warm-up; compile apart.
Usage (GPU): PYTHONPATH=. python3 benchmarks/kernels.py [--only a,b,c,d,e,f,g]
CPU smoke run of the script itself (tiny shapes, interpret mode): --smoke
"""
from __future__ import annotations

import argparse
import re
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from sampling import compilation_cache
import pallas_kernels as pk
from pallas_kernels import layer_dense_mgpu, reference
from pallas_kernels.dispatch import is_hopper
from pallas_kernels.layer_dense import tiling_error
from accel.fastvar import pts_scores
from accel.sparvar import csla_layout

INFINITY_1024 = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
VAR_256 = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)


# ------------------------------------------------------------------ measuring
def timeit(fn, arg_sets, calls: int, reps: int = 5, warmup: int = 3, donate=()):
  """(compile s, median ms per call) of jit(fn) over back-to-back calls on rotating inputs.

  With `donate`, those arguments are donated and each call's outputs (one per
  donated argument, in order) replace them in their input set (in-place kernels).
  """
  jitted = jax.jit(fn, donate_argnums=donate)
  t0 = time.perf_counter()
  compiled = jitted.lower(*arg_sets[0]).compile()
  compile_s = time.perf_counter() - t0
  sets = [list(a) for a in arg_sets]

  def run(n):
    out = None
    for i in range(n):
      args = sets[i % len(sets)]
      out = compiled(*args)
      for pos, o in zip(donate, out if isinstance(out, (list, tuple)) else [out]):
        args[pos] = o
    jax.block_until_ready(out)

  run(warmup)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    run(calls)
    times.append((time.perf_counter() - t0) / calls * 1e3)
  return compile_s, statistics.median(times)


def rel_err(got, want) -> float:
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
  if not np.isfinite(got).all():
    return float('nan')
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def ceilings(smoke: bool) -> dict:
  """Measured device copy bandwidth (bytes read + written) and bf16 matmul rate."""
  n = 1 << (16 if smoke else 29)                       # 1 GiB of bf16
  xs = [jnp.ones((n,), jnp.bfloat16) * (i + 1) for i in range(2)]
  _, ms = timeit(lambda x: -x, [(x,) for x in xs], calls=4 if smoke else 20)
  copy_gbs = 2 * n * 2 / (ms * 1e-3) / 1e9
  m = 256 if smoke else 8192
  key = jax.random.key(0)
  a = [jax.random.normal(jax.random.fold_in(key, i), (m, m), jnp.bfloat16) for i in range(2)]
  _, ms = timeit(lambda x, y: x @ y, [(a[0], a[1]), (a[1], a[0])], calls=4 if smoke else 20)
  tflops = 2 * m ** 3 / (ms * 1e-3) / 1e12
  return dict(copy_gbs=copy_gbs, tflops=tflops)


def floor_ms(flops: float, nbytes: float, ceil: dict) -> tuple[float, float]:
  return flops / (ceil['tflops'] * 1e12) * 1e3, nbytes / (ceil['copy_gbs'] * 1e9) * 1e3


def table(title, header, rows):
  print(f'\n### {title}\n')
  print('| ' + ' | '.join(header) + ' |')
  print('| ' + ' | '.join('---' for _ in header) + ' |')
  for r in rows:
    print('| ' + ' | '.join(f'{c:.4g}' if isinstance(c, float) else str(c) for c in r) + ' |')


def _normal(key, shape, dtype=jnp.bfloat16):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _qkv_sets(b, lq, lk, h, d, n_sets, seed=0):
  key = jax.random.key(seed)
  out = []
  for i in range(n_sets):
    kq, kk, kv = jax.random.split(jax.random.fold_in(key, i), 3)
    out.append((_normal(kq, (b, lq, h, d)), _normal(kk, (b, lk, h, d)), _normal(kv, (b, lk, h, d))))
  return out


def _xla_f32(q, k, v, mask):
  f = lambda a: a.astype(jnp.float32)
  return jax.nn.dot_product_attention(f(q), f(k), f(v), mask=mask, implementation='xla')


# -------------------------------------------------------------------------- (a)
def bench_csla(args, ceil):
  smoke = args.smoke
  pns = (1, 2, 4, 6, 8) if smoke else INFINITY_1024
  b, h, d = 1, (2 if smoke else 24), (16 if smoke else 128)
  blk = 16 if smoke else 128
  sparse = csla_layout(pns, sink_scales=2 if smoke else 5, windows=(3, 5, 7),
                       block_q=blk, block_k=blk)
  lq, lk = sparse.lq, sparse.lk
  dense = pk.dense_layout(lq, lk, blk, blk)
  density = pk.layout_density(sparse)
  sets = _qkv_sets(b, lq, lk, h, d, 2)
  impl = 'interpret' if smoke else 'triton'

  q, k, v = sets[0]
  mask = jnp.asarray(sparse.dense())[None]
  errs = {
      'pallas csla': rel_err(pk.block_sparse_attention(q, k, v, sparse, impl=impl),
                             _xla_f32(q, k, v, mask)),
      'pallas dense': rel_err(pk.block_sparse_attention(q, k, v, dense, impl=impl),
                              _xla_f32(q, k, v, None)),
  }
  variants = {'pallas dense': lambda q, k, v: pk.block_sparse_attention(q, k, v, dense, impl=impl)}
  if not smoke:
    variants['cudnn dense (no mask)'] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation='cudnn')
    errs['cudnn dense (no mask)'] = rel_err(variants['cudnn dense (no mask)'](q, k, v),
                                            _xla_f32(q, k, v, None))
  for warps in ((4, 8) if not smoke else (4,)):
    for stages in ((2, 3) if not smoke else (2,)):
      variants[f'pallas csla w{warps} s{stages}'] = (
          lambda q, k, v, w=warps, s=stages: pk.block_sparse_attention(
              q, k, v, sparse, impl=impl, num_warps=w, num_stages=s))
  if not smoke:  # Mosaic GPU (Hopper): TMA takes key buffers of a multiple of 8 rows
    lk8 = -(-lk // 8) * 8
    sets8 = _qkv_sets(b, lq, lk8, h, d, 2)
    mosaic = {f'mosaic csla (kv buffer {lk8})': sparse,
              f'mosaic dense (kv buffer {lk8})': pk.dense_layout(lq, lk, blk, blk)}
    q8, k8, v8 = sets8[0]
    for name, lay in mosaic.items():
      variants[name] = lambda q, k, v, lay=lay: pk.block_sparse_attention(q, k, v, lay, impl='mosaic')
      errs[name] = rel_err(variants[name](q8, k8, v8),
                           _xla_f32(q8, k8[:, :lk], v8[:, :lk], mask if lay is sparse else None))
  calls = 2 if smoke else 50
  res = {name: timeit(fn, sets8 if name.startswith('mosaic') else sets, calls)
         for name, fn in variants.items()}
  del mask

  tiles = int(sparse.kv_count.sum()) * blk * blk
  flops = 4 * b * h * d * tiles
  kv_blocks = len(np.unique(np.concatenate([sparse.kv_ids[0, u, :c] for u, c in
                                            enumerate(sparse.kv_count[0])])))
  nbytes = 2 * (2 * b * lq * h * d + 2 * b * min(kv_blocks * blk, lk) * h * d)
  f_ms, b_ms = floor_ms(flops, nbytes, ceil)
  dense_flops_ms, _ = floor_ms(4 * b * h * d * lq * lk, 0, ceil)
  best = min((n for n in res if 'csla' in n), key=lambda n: res[n][1])
  base = res.get('cudnn dense (no mask)', res['pallas dense'])[1]
  rows = []
  for name, (cs, ms) in res.items():
    kind = name.split()[0]
    dense_ms = next(t for n, (_, t) in res.items() if n.startswith(f'{kind} dense'))
    ideal = dense_ms / ms * density if 'csla' in name else ''
    rows.append((name, ms, base / ms, ideal, errs.get(name, errs.get(name.split(' w')[0], '')), cs))
  print(f'\n(a) CSLA: q {lq}, kv {lk}, {h} heads, head dim {d}, bf16, batch {b}; tile density '
        f'{density:.4f} (ideal speedup {1 / density:.2f}x); best variant: {best}')
  print(f'floor of the CSLA layout: {f_ms:.4f} ms of matmul, {b_ms:.4f} ms of bytes; '
        f'dense matmul floor {dense_flops_ms:.4f} ms')
  table('(a) SparVAR Table 1 shape', ['variant', 'median ms', 'speedup vs cudnn dense',
                                     'fraction of ideal (vs the same kernel dense)', 'rel err',
                                     'compile s'], rows)


# -------------------------------------------------------------------------- (b)
def _train_variants(mask_np, layout, impl, smoke, bwd_configs):
  mask = jnp.asarray(mask_np)[None, None]
  fwd = {'pallas': lambda q, k, v: pk.block_sparse_attention(q, k, v, layout, impl=impl)}
  for cfg in bwd_configs:   # e.g. '32x64w4': backward sub-blocks and warps
    blocks, warps = cfg.split('w')
    sq, sk = (int(x) for x in blocks.split('x'))
    fwd[f'pallas bwd {cfg}'] = lambda q, k, v, sq=sq, sk=sk, w=int(warps): (
        pk.block_sparse_attention(q, k, v, layout, impl=impl, bwd_block_q=sq, bwd_block_k=sk,
                                  bwd_num_warps=w))
  if not smoke:  # Mosaic GPU forward and backward (Hopper; pads lengths to a multiple of 8)
    fwd['pallas mosaic'] = lambda q, k, v: pk.block_sparse_attention(q, k, v, layout, impl='mosaic')
  fwd['xla + mask'] = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=mask, implementation='xla')
  if not smoke:
    fwd['cudnn + mask'] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=mask, implementation='cudnn')
    fwd['cudnn + mask, padded to 128'] = _padded_cudnn(mask_np)
  return fwd


def _padded_cudnn(mask_np):
  """cuDNN with an explicit mask at a length it takes: keys padded to a multiple of 128
  and masked out; padded queries see key 0; the output is cut back (pads included in time)."""
  n = mask_np.shape[0]
  p = -(-n // 128) * 128
  padded = np.zeros((p, p), bool)
  padded[:n, :n] = mask_np
  padded[n:, 0] = True
  mask = jnp.asarray(padded)[None, None]

  def run(q, k, v):
    pad = lambda a: jnp.pad(a, ((0, 0), (0, p - n), (0, 0), (0, 0)))
    return jax.nn.dot_product_attention(pad(q), pad(k), pad(v), mask=mask,
                                        implementation='cudnn')[:, :n]
  return run


def _fwd_bwd(f):
  def run(q, k, v, g):
    out, vjp = jax.vjp(f, q, k, v)
    return vjp(g)
  return run


def bench_training(args, ceil):
  smoke = args.smoke
  configs = ([('tiny', (1, 2, 3, 5), 2, 2, 16)] if smoke else
             [('VAR-d16 256px', VAR_256, 32, 16, 64), ('1024px 13 scales', INFINITY_1024, 2, 16, 128)])
  impl = 'interpret' if smoke else 'triton'
  for name, pns, b, h, d in configs:
    blk = 16 if smoke else 128
    layout = pk.scale_causal_layout(pns, blk, blk)
    levels = pk.schedule_levels(pns)
    mask_np = levels[:, None] >= levels[None]
    L = len(levels)
    sets = _qkv_sets(b, L, L, h, d, 2, seed=1)
    gs = [_normal(jax.random.key(10 + i), (b, L, h, d)) for i in range(2)]
    fwd = _train_variants(mask_np, layout, impl, smoke,
                          [c for c in args.bwd_configs.split(',') if c])

    # Checks on one batch row (the f32 XLA reference of L 10521 is large).
    q, k, v = (a[:1] for a in sets[0])
    g = gs[0][:1]
    ref_out, ref_vjp = jax.vjp(lambda *a: _xla_f32(*a, jnp.asarray(mask_np)[None, None]), q, k, v)
    ref_grads = ref_vjp(g.astype(jnp.float32))
    errs = {}
    for vname, f in list(fwd.items()):
      try:
        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        errs[vname] = [rel_err(out, ref_out)] + [rel_err(a, r) for a, r in zip(vjp(g), ref_grads)]
      except Exception as e:  # e.g. cuDNN refuses a masked length
        print(f'{vname} at L {L} failed its check: {type(e).__name__}: {str(e)[:300]}')
        del fwd[vname]
    del ref_out, ref_vjp, ref_grads

    calls = 2 if smoke else (20 if L > 4000 else 50)
    rows = []
    for vname, f in fwd.items():
      try:
        cf, tf = timeit(f, sets, calls)
        cb, tb = timeit(_fwd_bwd(f), [s + (gg,) for s, gg in zip(sets, gs)], calls)
      except Exception as e:  # e.g. XLA's dense logits out of memory at L 10521
        print(f'{vname} at L {L} failed: {type(e).__name__}: {str(e)[:300]}')
        continue
      rows.append((vname, tf, tb, cf + cb, ' / '.join(f'{e:.1e}' for e in errs[vname])))
    others = [r[2] for r in rows if not r[0].startswith('pallas')]
    mine = sorted(r[2] for r in rows if r[0].startswith('pallas'))
    speedup = f'{min(others) / mine[0]:.2f}x' if others and mine else 'n/a'
    density = pk.layout_density(layout)
    flops_fwd = 4 * b * h * d * int(layout.kv_count.sum()) * blk * blk
    # Bytes: q, k, v read and o written (forward); q, k, v, o, dO read and dq, dk,
    # dv written (backward): 12 tensors of [B, L, H, D] bf16.
    f_ms, b_ms = floor_ms(3.5 * flops_fwd, 12 * b * L * h * d * 2, ceil)
    print(f'\n(b) {name}: L {L}, batch {b}, {h} heads, head dim {d}, bf16; tile density '
          f'{density:.4f}; fwd+bwd floor {f_ms:.4f} ms matmul (3.5x forward FLOPs), '
          f'{b_ms:.4f} ms bytes; pallas fwd+bwd speedup over the best other: {speedup}')
    table(f'(b) scale-causal training attention, {name}',
          ['variant', 'fwd ms', 'fwd+bwd ms', 'compile s', 'rel err out / dq / dk / dv'], rows)


# -------------------------------------------------------------------------- (c)
def grouped(fn, sets, group: int):
  """fn over `group` input sets in one program (one host dispatch for `group` kernels),
  so small kernels are timed on the device rather than by the host's dispatch rate."""
  n = len(sets[0])

  def many(*flat):
    return [fn(*flat[i * n:(i + 1) * n]) for i in range(group)]
  return many, [sum(sets[i:i + group], ()) for i in range(0, len(sets) - group + 1, group)]


def timeit_grouped(fn, sets, group, calls, donate=()):
  many, flat_sets = grouped(fn, sets, group)
  donated = tuple(i * len(sets[0]) + d for i in range(group) for d in donate)
  cs, ms = timeit(many, flat_sets, max(1, calls // group), donate=donated)
  return cs, ms / group


def bench_gather(args, ceil):
  smoke = args.smoke
  impl = 'interpret' if smoke else 'triton'
  c = 64 if smoke else 2048
  shapes = [(2, 64, 30)] if smoke else [(b, n, k) for b in (2, 32)
                                        for n, k in ((1024, 614), (1600, 800))]
  rows = []
  for b, n, k in shapes:
    n_sets = max(2, int(np.ceil(200e6 / (b * n * c * 2))))
    group = 8 if b * n * c * 2 < 32e6 else 1
    n_sets = -(-n_sets // group) * group
    key = jax.random.key(3)
    xs = [_normal(jax.random.fold_in(key, i), (b, n, c)) for i in range(n_sets)]
    scores = [pts_scores(x) for x in xs]
    idx = [jax.lax.top_k(s, k)[1] for s in scores]
    new = [_normal(jax.random.fold_in(key, 100 + i), (b, k, c)) for i in range(n_sets)]

    ours_g = lambda x, i: pk.gather_rows(x, i, impl=impl)
    xla_g = reference.gather_rows
    ours_s = lambda base, r, i: pk.token_scatter(base, r, i, impl=impl)
    xla_s = reference.scatter_rows
    ok_g = bool((np.asarray(ours_g(xs[0], idx[0])) == np.asarray(xla_g(xs[0], idx[0]))).all())
    ok_s = bool((np.asarray(ours_s(xs[0] * 1, new[0], idx[0]))
                 == np.asarray(xla_s(xs[0], new[0], idx[0]))).all())
    calls = 2 if smoke else 200
    moved = 2 * b * k * c * 2 + b * k * 4
    t = lambda fn, sets, **kw: timeit_grouped(fn, sets, group, calls, **kw)
    timings = {
        'gather pallas': t(ours_g, list(zip(xs, idx))),
        'gather xla': t(xla_g, list(zip(xs, idx))),
        'top-k + gather pallas': t(lambda x, s: pk.topk_gather(x, s, k, impl=impl),
                                   list(zip(xs, scores))),
        'top-k + gather xla': t(lambda x, s: xla_g(x, jax.lax.top_k(s, k)[1]),
                                list(zip(xs, scores))),
        'scatter pallas (in place)': t(ours_s, [(x * 1, r, i) for x, r, i in zip(xs, new, idx)],
                                       donate=(0,)),
        'scatter xla (in place)': t(xla_s, [(x * 1, r, i) for x, r, i in zip(xs, new, idx)],
                                    donate=(0,)),
    }
    for vname, (_, ms) in timings.items():
      gbs = moved / (ms * 1e-3) / 1e9 if 'top-k' not in vname else float('nan')
      ok = ok_g if 'gather' in vname else ok_s
      rows.append((f'B {b}, N {n}, k {k}', vname, group, ms * 1e3, gbs, gbs / ceil['copy_gbs'],
                   ok))
  table(f'(c) top-k gather/scatter, C {c}, bf16 (bandwidth: 2 x k x C x 2 B + indices; '
        f'device copy {ceil["copy_gbs"]:.0f} GB/s)',
        ['shape', 'variant', 'kernels per dispatch', 'median us per kernel', 'GB/s',
         'fraction of copy', 'exact'], rows)


# -------------------------------------------------------------------------- (d)
def _cs4a_idx(key, b, h, g, lk, n):
  """[B, H, G, n] distinct key positions per (b, h, group), ascending (as a caller passes them)."""
  picks = jnp.argsort(jax.random.uniform(key, (b, h, g, lk)), axis=-1)[..., :n]
  return jnp.sort(picks, axis=-1).astype(jnp.int32)


def _gathered_variants(group, impl, dense, tilings):
  """name -> fn(q, k, v, idx): dense attention (idx unused), then our kernel per tiling."""
  variants = {f'{dense} dense (no mask)': lambda q, k, v, idx: jax.nn.dot_product_attention(
      q, k, v, implementation=dense)}
  for bk, w, st in tilings:
    variants[f'pallas bk{bk} w{w} s{st}'] = (
        lambda q, k, v, idx, bk=bk, w=w, st=st: pk.gathered_attention(
            q, k, v, idx, group=group, impl=impl, block_k=bk, num_warps=w, num_stages=st))
  return variants


def bench_gathered(args, ceil):
  smoke = args.smoke
  # (name, scales, B, H, D, group, n): n = the decision scale's top 20 % plus the sinks
  # (scales <= 5): 1024 px, 40x40: 0.2 x 4121 = 824 + 121; 256 px, 10x10: 0.2 x 255 = 51 + 55.
  configs = ([('tiny', (1, 2, 4, 6, 8), 2, 2, 16, 32, 20)] if smoke else
             [('Infinity-2B 1024px', INFINITY_1024, 2, 16, 128, 192, 945),
              ('VAR-d30 256px', VAR_256, 2, 30, 64, 192, 106)])
  # (block_k, num_warps, num_stages); the first is the default.
  tilings = [(16, 4, 2)] if smoke else [(64, 4, 2), (32, 4, 2), (64, 8, 2), (64, 4, 3), (128, 8, 2)]
  dense = 'xla' if smoke else 'cudnn'
  for name, pns, b, h, d, group, n in configs:
    lq, lk = pns[-1] ** 2, sum(p * p for p in pns)
    g = -(-lq // group)
    set_bytes = 2 * (b * lq * h * d + 2 * b * lk * h * d)
    n_sets = 8 if smoke else max(2, int(np.ceil(200e6 / set_bytes)))  # rotate beyond L2
    per_dispatch = 8 if set_bytes < 32e6 else 1
    n_sets = -(-n_sets // per_dispatch) * per_dispatch
    sets = [qkv + (_cs4a_idx(jax.random.key(20 + i), b, h, g, lk, n),)
            for i, qkv in enumerate(_qkv_sets(b, lq, lk, h, d, n_sets, seed=2))]
    variants = _gathered_variants(group, 'interpret' if smoke else 'triton', dense, tilings)

    q, k, v, idx = sets[0]
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    wants = {'pallas': reference.gathered_attention(*f32, idx, group, 1 / np.sqrt(d), lk)[0],
             dense: _xla_f32(q, k, v, None)}
    errs, res = {}, {}
    for vname, f in variants.items():
      try:
        errs[vname] = rel_err(f(q, k, v, idx), wants[vname.split()[0]])
        res[vname] = timeit_grouped(f, sets, per_dispatch, 2 if smoke else 50)
      except Exception as e:  # e.g. a tiling out of shared memory
        print(f'{vname} failed: {type(e).__name__}: {str(e)[:300]}')
    del wants, f32

    flops = 4 * b * h * lq * n * d
    # q read and out written once; each query group's n K and V rows read once; idx.
    nbytes = 2 * (2 * b * lq * h * d + b * h * g * 2 * n * d) + 4 * b * h * g * n
    f_ms, b_ms = floor_ms(flops, nbytes, ceil)
    base = res.get(f'{dense} dense (no mask)', (0, float('nan')))[1]
    rows = [(vname, ms, base / ms, max(f_ms, b_ms) / ms if vname.startswith('pallas') else '',
             errs[vname], cs) for vname, (cs, ms) in res.items()]
    print(f'\n(d) {name}: q {lq} (last scale), kv {lk}, batch {b}, {h} heads, head dim {d}, '
          f'bf16; group {group} ({g} groups), n {n} keys per group (density {n / lk:.4f}); '
          f'floor {f_ms:.4f} ms of matmul ({flops:.3g} FLOPs), {b_ms:.4f} ms of bytes '
          f'({nbytes / 1e6:.1f} MB); {per_dispatch} kernels per dispatch')
    table(f'(d) gathered-key attention (CS4A), {name}',
          ['variant', 'median ms', f'speedup vs {dense} dense', 'fraction of floor', 'rel err',
           'compile s'], rows)


# -------------------------------------------------------------------------- (e)
def bench_column_sums(args, ceil):
  smoke = args.smoke
  # Infinity-2B 1024 px, decision scale 40x40: its 1600 queries over the 4121 keys up to it,
  # in the 13-scale KV buffer (10521 rows); CS4A's query groups of 192.
  b, h, d, lq, kv_len, lk, group = ((2, 2, 16, 40, 37, 64, 16) if smoke else
                                    (2, 16, 128, 1600, 4121, 10521, 192))
  g, scale = -(-lq // group), 1 / np.sqrt(d)
  flash_impls = ['interpret'] if smoke else ['triton', 'mosaic']
  kimpl = 'interpret' if smoke else 'triton'
  dense = 'xla' if smoke else 'cudnn'
  # (block_k, num_warps); the first is the default.
  tilings = [(16, 4)] if smoke else [(64, 4), (64, 8), (128, 4), (128, 8), (256, 8), (32, 4)]
  layout = pk.dense_layout(lq, kv_len, pk.default_block(lq), pk.default_block(kv_len))
  end = min(lk, layout.num_k_blocks * layout.block_k)   # what block_sparse_attention may read

  def flash(impl):
    return lambda q, k, v: pk.block_sparse_attention(q, k[:, :end], v[:, :end], layout, scale=scale,
                                                     return_lse=True, impl=impl)

  def sums(bk, w):
    return lambda q, k, lse: pk.group_column_sums(q, k, lse, group=group, scale=scale,
                                                  kv_len=kv_len, impl=kimpl, block_k=bk,
                                                  num_warps=w)

  def both(impl, bk, w):
    f, c = flash(impl), sums(bk, w)

    def run(q, k, v):
      out, lse = f(q, k, v)
      return out, c(q, k, lse)
    return run

  # KV buffers: zeros past kv_len, as the sampler's cache has (the flash kernel reads up to `end`).
  sets = [(q, k.at[:, kv_len:].set(0), v.at[:, kv_len:].set(0))
          for q, k, v in _qkv_sets(b, lq, lk, h, d, 2, seed=3)]   # 2 x 185 MB: beyond L2
  lse_sets = [(q, k, flash(flash_impls[0])(q, k, v)[1]) for q, k, v in sets]
  dense_sets = [(q, k[:, :kv_len], v[:, :kv_len]) for q, k, v in sets]
  # name -> (fn, its input sets)
  variants = {'(1) plain jnp (softmax, P V, group sums by einsum)': (
      lambda q, k, v: reference.dense_column_sums(q, k, v, kv_len, scale, group), sets)}
  for impl in flash_impls:
    variants[f'(2) flash fwd + lse, {impl}'] = (flash(impl), sets)
  for bk, w in tilings:
    variants[f'(3) column sums bk{bk} w{w}'] = (sums(bk, w), lse_sets)
  variants[f'{dense} dense (no mask)'] = (
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=dense),
      dense_sets)

  # Checks against float32 XLA on the same bf16 inputs: out, lse and the sums.
  q, k, v = sets[0]
  f32 = [q.astype(jnp.float32)] + [a[:, :kv_len].astype(jnp.float32) for a in (k, v)]
  want = dict(zip(('out', 'sums'), reference.dense_column_sums(*f32, kv_len, scale, group)))
  want['lse'] = jax.nn.logsumexp(jnp.einsum('bqhd,bkhd->bhqk', f32[0], f32[1]) * scale, axis=-1)
  del f32
  lse_err = lambda lse: f'lse max abs {float(jnp.max(jnp.abs(lse - want["lse"]))):.1e}'
  errs, res = {}, {}

  def check(vname, got):
    if vname.startswith('(2)'):
      return f'out {rel_err(got[0], want["out"]):.1e} / {lse_err(got[1])}'
    if vname.startswith('(3)'):
      return f'sums {rel_err(got, want["sums"]):.1e}'
    if isinstance(got, tuple):
      return f'out {rel_err(got[0], want["out"]):.1e} / sums {rel_err(got[1], want["sums"]):.1e}'
    return f'out {rel_err(got, want["out"]):.1e}'

  def measure(vname, f, arg_sets):
    try:
      errs[vname] = check(vname, f(*arg_sets[0]))   # unjitted: timeit's compile stays apart
      res[vname] = timeit(f, arg_sets, 2 if smoke else 50)
    except Exception as e:  # e.g. Mosaic refusing the shapes, a tiling out of shared memory
      print(f'{vname} failed: {type(e).__name__}: {str(e)[:300]}')

  for vname, (f, arg_sets) in variants.items():
    measure(vname, f, arg_sets)
  # (4) = (2) + (3) in one program, with the default tiling and with the best of (3).
  timed = [(bk, w) for bk, w in tilings if f'(3) column sums bk{bk} w{w}' in res]
  best = (min(timed, key=lambda t: res[f'(3) column sums bk{t[0]} w{t[1]}'][1]) if timed
          else tilings[0])
  for impl in flash_impls:
    for bk, w in dict.fromkeys([tilings[0], best]):
      measure(f'(4) flash {impl} + column sums bk{bk} w{w}', both(impl, bk, w), sets)
  want.clear()

  flops = 2 * b * h * lq * kv_len * d
  nbytes = 2 * b * (lq + kv_len) * h * d + 4 * b * h * lq + 4 * b * h * g * kv_len  # q, k, lse, out
  f_ms, b_ms = floor_ms(flops, nbytes, ceil)
  dense_f_ms, _ = floor_ms(2 * flops, 0, ceil)
  plain = res.get(next(iter(variants)), (0, float('nan')))[1]
  base = res.get(f'{dense} dense (no mask)', (0, float('nan')))[1]
  rows = [(vname, ms, plain / ms, base / ms,
           max(f_ms, b_ms) / ms if vname.startswith('(3)') else '', errs[vname], cs)
          for vname, (cs, ms) in res.items()]
  print(f'\n(e) column sums per query group (SparVAR CS4A decision scale): q {lq}, kv {kv_len} '
        f'(buffer {lk}), batch {b}, {h} heads, head dim {d}, bf16, group {group} ({g} groups); '
        f'floor of (3) {f_ms:.4f} ms of matmul ({flops:.3g} FLOPs), {b_ms:.4f} ms of bytes '
        f'({nbytes / 1e6:.1f} MB: q, k, lse, sums); dense attention matmul floor '
        f'{dense_f_ms:.4f} ms; best (3) tiling bk{best[0]} w{best[1]}')
  table('(e) column sums per query group, Infinity-2B decision scale',
        ['variant', 'median ms', 'speedup vs (1)', f'speedup vs {dense} dense',
         'fraction of floor', 'error vs float32 XLA', 'compile s'], rows)


# -------------------------------------------------------------------------- (g)
LAYER_DENSE_CONFIG = r'(?:m(\d+):)?(\d+)x(\d+)s(\d+)w(\d+)p(\d+)'   # --layer_dense_configs' entries
MOSAIC_CONFIG = r'(\d+)x(\d+)s(\d+)p(\d+)'                        # --layer_dense_mosaic_configs'


def config_numbers(pattern: str, configs: str, flag: str) -> list[tuple[str, tuple[int, ...]]]:
  """(entry, its numbers (0 for an absent group)) of each comma-separated entry of `configs`; an entry
  not of `pattern`'s form is a ValueError naming `flag`."""
  out = []
  for cfg in filter(None, configs.split(',')):
    match = re.fullmatch(pattern, cfg)
    if not match:
      raise ValueError(f'{flag}: {cfg!r} is not of the form {pattern}')
    out.append((cfg, tuple(int(g or 0) for g in match.groups())))
  return out


def layer_dense_tilings(configs: str, k: int, n: int):
  """(row name, layer_dense tiling) of each of --layer_dense_configs ('128x64s4w4p3': block_n x
  block_k, K splits (0: layer_dense's choice), warps, stages; 'm128:' ahead sets the row block) that fits K
  and N."""
  for cfg, (bm, bn, bk, splits, warps, stages) in config_numbers(LAYER_DENSE_CONFIG, configs, '--layer_dense_configs'):
    if not tiling_error(k, n, bn, bk, splits or 1, bm):   # splits 0: chosen by layer_dense
      yield f'pallas {cfg}', dict(block_m=bm, block_n=bn, block_k=bk, splits=splits, num_warps=warps, num_stages=stages)


def mosaic_tilings(configs: str, k: int, n: int):
  """(row name, Mosaic GPU tiling) of each of --layer_dense_mosaic_configs ('64x128s1p4': tile_m x
  tile_n, K splits, stages) that fits K and N."""
  for cfg, numbers in config_numbers(MOSAIC_CONFIG, configs, '--layer_dense_mosaic_configs'):
    tiling = layer_dense_mgpu.Tiling(*numbers)
    if not layer_dense_mgpu.tiling_error(k, n, tiling):
      yield f'mosaic {cfg}', tiling


def separate_in_turn(x, ws, bs):
  """sum_i x @ ws[i] + bs[i], the layers in turn as an unrolled model runs them: each product waits
  for the sum before it (an optimization barrier), so XLA can neither run them side by side nor
  merge them into one GEMM of the concatenated weights."""
  acc = jnp.zeros((x.shape[0], ws[0].shape[1]), x.dtype)
  for wi, bi in zip(ws, bs):
    acc, x = lax.optimization_barrier((acc + x @ wi + bi, x))
  return acc


def bench_layer_dense(args, ceil):
  """One Dense of each of --layer_dense_depth layers, its weights stacked on a layer axis (a scanned block's),
  summed over the layers in a loop: `pk.layer_dense` (weights read in place) against XLA's GEMM of
  the copied slice (the scan without the kernel) and of separate weights (the unrolled blocks),
  with the floor: every layer's weights read once, or its FLOPs at the peak where those take longer."""
  impl = 'interpret' if args.smoke else 'triton'
  depth, dtype = (2, jnp.float32) if args.smoke else (args.layer_dense_depth, jnp.bfloat16)
  shapes = [(64, 128)] if args.smoke else [tuple(map(int, s.split('x'))) for s in args.layer_dense_shapes.split(',')]
  row_counts = (2, 16) if args.smoke else tuple(int(r) for r in args.layer_dense_rows.split(','))
  rows = []
  for k, n in shapes:
    w = (jax.random.normal(jax.random.key(k + n), (depth, k, n)) / np.sqrt(k)).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (depth, n)).astype(dtype)
    ws, bs = list(w), list(b)
    for m in row_counts:
      x = jax.random.normal(jax.random.key(m), (m, k), dtype)
      want = sum(x.astype(jnp.float32) @ ws[i].astype(jnp.float32) + bs[i] for i in range(depth))
      def looped(layer_impl, **tiling):
        return lambda x, w, b: jax.lax.fori_loop(
            0, depth, lambda i, acc: acc + pk.layer_dense(x, w, b, i, impl=layer_impl, **tiling),
            jnp.zeros((m, n), dtype), unroll=args.layer_dense_unroll)
      variants = {
          'pallas layer_dense': (looped(impl), (x, w, b)),
          'XLA, slice copied': (looped('reference'), (x, w, b)),
          'XLA, separate weights': (separate_in_turn, (x, ws, bs)),
      }
      for name, tiling in layer_dense_tilings(args.layer_dense_configs, k, n):
        variants[name] = (looped(impl, **tiling), (x, w, b))
      if not args.smoke and is_hopper() and not layer_dense_mgpu.unsupported(x, w):
        variants['mosaic layer_dense'] = (looped('mosaic'), (x, w, b))
        for name, tiling in mosaic_tilings(args.layer_dense_mosaic_configs, k, n):
          variants[name] = (looped('mosaic', mosaic_tiling=tiling), (x, w, b))
      floor = max(floor_ms(2 * depth * m * k * n, depth * k * n * jnp.dtype(dtype).itemsize, ceil))
      for name, (fn, inputs) in variants.items():
        compile_s, ms = timeit(fn, [inputs], 2 if args.smoke else 50)
        err = rel_err(jax.jit(fn)(*inputs), want)
        rows.append((f'{depth} x [{k}, {n}], {m} rows', name, ms * 1e3, floor / ms, err, compile_s))
  table('(g) a dense layer of stacked weights per layer, summed over the layers (floor: the weights read once, '
        'or the FLOPs at the peak)',
        ['shape', 'variant', 'median us', 'fraction of floor', 'rel. L2 error', 'compile s'], rows)


# -------------------------------------------------------------------------- (h)
FEW_TOKEN_CONFIG = r'(\d+)x(\d+)w(\d+)s(\d+)'   # --few_token_configs' entries: block_q x block_k, warps, stages
FEW_TOKEN_SHAPE = r'(\d+)x(\d+)x(\d+)'          # --few_token_shapes' entries: B x Lq x Lk


def _chained(attend, n: int):
  """(q, k, v, mask) -> q after n calls q <- q + attend(q, k, v, mask): each call waits on the last."""
  def run(q, k, v, mask):
    for _ in range(n):
      q = q + attend(q, k, v, mask)
    return q
  return run


def _few_token_variants(args, impl: str):
  """(name, attend(q, k, v, key mask [B, Lk] | None)): cuDNN's call, then the kernel at each tiling."""
  def cudnn(q, k, v, mask):
    dense = None if mask is None else jnp.broadcast_to(mask[:, None, None, :], (q.shape[0], 1, q.shape[1], k.shape[1]))
    return jax.nn.dot_product_attention(q, k, v, mask=dense, implementation='xla' if args.smoke else 'cudnn')

  kernel = lambda t: lambda q, k, v, mask: pk.few_token_attention(q, k, v, key_mask=mask, tiling=t, impl=impl)
  return [('cuDNN', cudnn)] + [(f'kernel {cfg}', kernel(pk.FewTokenTiling(*nums)))
                               for cfg, nums in config_numbers(FEW_TOKEN_CONFIG, args.few_token_configs,
                                                               '--few_token_configs')]


def bench_few_token(args, ceil):
  del ceil
  h, d = (2, 80) if args.smoke else (16, 80)
  n = 2 if args.smoke else args.few_token_chain
  shapes = [(1, 71, 160)] if args.smoke else [nums for _, nums in config_numbers(
      FEW_TOKEN_SHAPE, args.few_token_shapes, '--few_token_shapes')]
  variants = _few_token_variants(args, 'interpret' if args.smoke else 'triton')
  rows = []
  for b, lq, lk in shapes:
    sets = _qkv_sets(b, lq, lk, h, d, n_sets=2)
    seen = np.ones((b, lk), bool)
    seen[:, : lk // 5] = False   # the encoder's masked-out positions: a fifth of the keys hidden
    for mname, mask in (('unmasked', None), ('key mask', jnp.asarray(seen))):
      q, k, v = sets[0]
      want = _xla_f32(q, k, v, None if mask is None else mask[:, None, None, :])
      for vname, attend in variants:
        err = rel_err(jax.jit(attend)(q, k, v, mask), want)
        compile_s, ms = timeit(_chained(attend, n), [s + (mask,) for s in sets], calls=2 if args.smoke else 20)
        rows.append((f'{b}x{lq}x{lk}', mname, vname, ms * 1e3 / n, err, compile_s))
  table(f'(h) attention over a few hundred tokens (H {h}, D {d}, bf16), {n} chained calls a program',
        ['B x Lq x Lk', 'keys', 'variant', 'us a call', 'rel. L2 error', 'compile s'], rows)


# -------------------------------------------------------------------------- (f)
def bench_top_k(args, ceil):
  impl = 'interpret' if args.smoke else 'triton'
  shapes = [(1, 2, 2, 300, 60)] if args.smoke else [(2, 16, 9, 4121, 824), (2, 28, 9, 4121, 824)]
  rows = []
  for b, h, g, n, k in shapes:
    n_sets = 2 if args.smoke else max(2, int(np.ceil(200e6 / (b * h * g * n * 4))))
    xs = [(jax.random.uniform(jax.random.fold_in(jax.random.key(5), i), (b, h, g, n)),)
          for i in range(n_sets)]
    exact = bool((np.asarray(pk.top_k_indices(xs[0][0], k, impl=impl))
                  == np.asarray(reference.top_k_indices(xs[0][0], k))).all())
    calls = 2 if args.smoke else 100
    for vname, fn in (('pallas top_k_indices', lambda x: pk.top_k_indices(x, k, impl=impl)),
                      ('lax.top_k', lambda x: jax.lax.top_k(x, k)[1])):
      compile_s, ms = timeit(fn, xs, calls)
      gbs = (b * h * g * (n + k) * 4) / (ms * 1e-3) / 1e9
      rows.append((f'B {b}, H {h}, G {g}, N {n}, k {k}', vname, ms * 1e3, gbs,
                   gbs / ceil['copy_gbs'], exact if 'pallas' in vname else '', compile_s))
  table('(f) top-k selection, float32 (bandwidth: rows x (N + k) x 4 B)',
        ['shape', 'variant', 'median us', 'GB/s', 'fraction of copy', 'same set', 'compile s'], rows)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--only', default='a,b,c,d,e,f,g,h')
  p.add_argument('--smoke', action='store_true', help='tiny shapes, interpret mode (CPU)')
  p.add_argument('--layer_dense_configs', default='',
                 help="extra tilings for (g), e.g. '128x64s4w4p3' (block_n x block_k, K splits, warps, stages)")
  p.add_argument('--layer_dense_mosaic_configs', default='',
                 help="extra tilings of (g)'s Mosaic GPU kernel on Hopper, e.g. '64x128s1p4' (tile_m x tile_n "
                 "of a warpgroup, K splits, stages)")
  p.add_argument('--layer_dense_rows', default='2,16,64,128', help='row counts of (g)')
  p.add_argument('--layer_dense_shapes', default='2048x6144,2048x2048,2048x8192,8192x2048',
                 help="KxN weight shapes of (g) (default Infinity-2B's; "
                 "MAR-H's: 1280x3840,1280x1280,1280x5120,5120x1280)")
  p.add_argument('--layer_dense_depth', type=int, default=32, help='layers of (g)')
  p.add_argument('--layer_dense_unroll', type=int, default=1,
                 help="layers per iteration of (g)'s loop: at a few hundred rows and less an iteration of "
                 'one layer costs the same ~14 us on the H200 whatever it runs, so compare kernels there at 4-5')
  p.add_argument('--few_token_configs', default='64x64w4s1,64x128w4s1,128x64w8s1,128x128w8s1,64x64w4s2,32x64w4s1',
                 help="tilings of (h)'s few-token kernel: block_q x block_k, warps, stages")
  p.add_argument('--few_token_shapes', default='2x320x320,1x320x320,1x71x320',
                 help="(h)'s calls, B x Lq x Lk: MAR-H's refreshes (both CFG halves), a cached iteration's "
                 'decoder and encoder at batch 1')
  p.add_argument('--few_token_chain', type=int, default=40, help="calls chained in one program in (h)")
  p.add_argument('--bwd_configs', default='',
                 help="extra backward variants for (b), e.g. '32x64w4,64x128w8'")
  args = compilation_cache.parse_args(p)
  for pattern, flag in ((LAYER_DENSE_CONFIG, 'layer_dense_configs'), (MOSAIC_CONFIG, 'layer_dense_mosaic_configs'),
                        (FEW_TOKEN_CONFIG, 'few_token_configs'),
                        (FEW_TOKEN_SHAPE, 'few_token_shapes')):
    try:
      config_numbers(pattern, getattr(args, flag), f'--{flag}')
    except ValueError as e:
      p.error(str(e))
  print(f'devices: {jax.devices()}; jax {jax.__version__}')
  ceil = ceilings(args.smoke)
  print(f'measured ceilings: copy {ceil["copy_gbs"]:.0f} GB/s (read + write), '
        f'bf16 matmul {ceil["tflops"]:.0f} TFLOP/s')
  parts = dict(a=bench_csla, b=bench_training, c=bench_gather, d=bench_gathered,
               e=bench_column_sums, f=bench_top_k, g=bench_layer_dense, h=bench_few_token)
  for part in args.only.split(','):
    try:
      parts[part](args, ceil)
    except Exception:  # report and go on: one lease runs every part
      print(f'\n({part}) FAILED:\n{traceback.format_exc()}')


if __name__ == '__main__':
  main()
