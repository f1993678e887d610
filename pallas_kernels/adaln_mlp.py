"""An adaLN MLP block on few rows, each weight read once: MAR's DiffLoss ResBlock at batch 1.

`adaln_mlp(x, shift, scale, gate, ln, mlp)` for x, shift, scale, gate [M, C], ln = (scale,
bias) [C] of the block's LayerNorm (or None: no affine), mlp = (w1 [C, F], b1 [F], w2 [F, C],
b2 [C]):

  h   = silu(modulate(LN(x), scale, shift) @ w1 + b1)
  out = x + gate * (h @ w2 + b2)          (gate None: h @ w2 + b2, the MLP's output alone)

computed in x's dtype as flax's LayerNorm and Dense layers compute it (statistics and products
in float32, each layer's output rounded to x's dtype, the bias added after the product's
rounding). At a denoiser step of a handful of rows XLA runs this as six to eight launches (the
LayerNorm and modulation, two GEMMs, the SiLU, the gate and residual), each a few microseconds
on a few rows. The kernels are two: `fc1` normalises, modulates and multiplies each column
block of w1 with its bias and SiLU applied to the float32 product, and `fc2` multiplies each
column block of w2 and adds bias, gate and residual, one program per column block, so every
SM streams its part of the weights once.

'auto' runs the kernels (Triton lowering, A100 and Hopper) on an NVIDIA GPU for at most
AUTO_MAX_ROWS rows, the reference elsewhere. The kernels have no backward: a gradient goes
through the reference.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch

AUTO_MAX_ROWS = 64     # rows up to which 'auto' runs the kernels (a prediction: NOTES.md)
BLOCK_M = 16           # the smallest row block of a Triton dot
BLOCK_N = 16           # columns per program: C = 1536 gives 96 programs a GEMM
BLOCK_K_CHOICES = (512, 256, 128, 64, 32, 16)   # the chunk of K (unrolled): the largest dividing C and F


def _layer_norm(x, ln, eps: float):
  """flax's LayerNorm (two-pass variance) of x [M, C] in float32, rounded to x's dtype."""
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  var = jnp.square(xf - mean).mean(-1, keepdims=True)
  mul = lax.rsqrt(var + eps)
  if ln is None:
    return ((xf - mean) * mul).astype(x.dtype)
  return ((xf - mean) * (mul * ln[0].astype(jnp.float32)) + ln[1].astype(jnp.float32)).astype(x.dtype)


def reference(x, shift, scale, gate, ln, mlp, eps: float = 1e-6):
  """The block as flax computes it, in x's dtype: [M, C] -> [M, C]."""
  w1, b1, w2, b2 = (a.astype(x.dtype) for a in mlp)
  h = jax.nn.silu(jnp.dot(_layer_norm(x, ln, eps) * (1 + scale) + shift, w1) + b1)
  y = jnp.dot(h, w2) + b2
  return y if gate is None else x + gate * y


_NT = (((1,), (1,)), ((), ()))   # a [M, K] . w [N, K]^T: the weights' rows are output columns


def _round(v, dtype):
  """v (float32) rounded to dtype and back: where the reference stores a layer's output."""
  return v.astype(dtype).astype(jnp.float32)


def _fc1_kernel(x_ref, shift_ref, scale_ref, *refs, affine: bool, eps: float, block_k: int):
  """h[:, cols] = silu(modulate(LN(x), scale, shift) @ w1[:, cols] + b1[cols]) for one column block.
  The chunks of K are unrolled: their loads depend on nothing computed, so they are all in flight
  at once (a loop would wait a DRAM latency per chunk)."""
  ln_refs, (w_ref, b_ref, h_ref) = (refs[:2], refs[2:]) if affine else ((), refs)
  dtype, chunks = x_ref.dtype, [pl.ds(t * block_k, block_k) for t in range(x_ref.shape[1] // block_k)]
  mean = m2 = jnp.zeros((x_ref.shape[0], 1), jnp.float32)
  for t, ks in enumerate(chunks):   # Chan's merge of each chunk's mean and sum of squared deviations
    xc = x_ref[:, ks].astype(jnp.float32)
    cm = jnp.mean(xc, axis=1, keepdims=True)
    delta, seen = cm - mean, t * block_k
    mean = mean + delta * (block_k / (seen + block_k))
    m2 = m2 + jnp.sum(jnp.square(xc - cm), axis=1, keepdims=True) + jnp.square(delta) * (seen * block_k / (seen + block_k))
  mul = lax.rsqrt(m2 / (len(chunks) * block_k) + eps)
  acc = jnp.zeros(h_ref.shape, jnp.float32)
  for ks in chunks:
    xn = (x_ref[:, ks].astype(jnp.float32) - mean) * mul
    if affine:
      xn = xn * ln_refs[0][ks].astype(jnp.float32)[None, :] + ln_refs[1][ks].astype(jnp.float32)[None, :]
    a = _round(_round(xn, dtype) * _round(1 + scale_ref[:, ks].astype(jnp.float32), dtype), dtype)
    a = (a + shift_ref[:, ks].astype(jnp.float32)).astype(dtype)
    acc += lax.dot_general(a, w_ref[:, ks].astype(dtype), _NT, preferred_element_type=jnp.float32)
  h = _round(_round(acc, dtype) + b_ref[...].astype(jnp.float32)[None, :], dtype)
  h_ref[...] = (h * _round(jax.nn.sigmoid(h), dtype)).astype(dtype)


def _fc2_kernel(h_ref, w_ref, b_ref, *refs, block_k: int):
  """out[:, cols] = h @ w2[:, cols] + b2[cols], then x + gate * that where refs = (x, gate, out);
  the chunks of K unrolled as in `_fc1_kernel`."""
  dtype, o_ref = h_ref.dtype, refs[-1]
  acc = jnp.zeros(o_ref.shape, jnp.float32)
  for t in range(h_ref.shape[1] // block_k):
    ks = pl.ds(t * block_k, block_k)
    acc += lax.dot_general(h_ref[:, ks], w_ref[:, ks].astype(dtype), _NT, preferred_element_type=jnp.float32)
  y = _round(_round(acc, dtype) + b_ref[...].astype(jnp.float32)[None, :], dtype)
  if len(refs) == 3:
    y = refs[0][...].astype(jnp.float32) + _round(refs[1][...].astype(jnp.float32) * y, dtype)
  o_ref[...] = y.astype(o_ref.dtype)


def _call(kernel, operands, specs, rows: int, cols: int, dtype, block_n: int, interpret: bool, num_warps: int,
          name: str):
  """One program per (row block, column block) of the [rows, cols] output."""
  return pl.pallas_call(
      kernel, grid=(rows // BLOCK_M, cols // block_n), in_specs=specs,
      out_specs=pl.BlockSpec((BLOCK_M, block_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((rows, cols), dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps),
      interpret=interpret, name=name)(*operands)


def _rows(c: int):
  return pl.BlockSpec((BLOCK_M, c), lambda i, j: (i, 0))


def _fused(x, shift, scale, gate, ln, mlp, eps, interpret, block_n, block_k, num_warps):
  """The two kernels on rows padded to BLOCK_M."""
  (m, c), (w1, b1, w2, b2), f = x.shape, mlp, mlp[0].shape[1]
  pad = -m % BLOCK_M
  x, shift, scale, gate = (None if a is None else jnp.pad(a, ((0, pad), (0, 0))) for a in (x, shift, scale, gate))
  rows = m + pad
  whole = lambda n: pl.BlockSpec((n,), lambda i, j: (0,))
  cols = lambda k: pl.BlockSpec((block_n, k), lambda i, j: (j, 0))   # w^T's rows: contiguous K
  col = pl.BlockSpec((block_n,), lambda i, j: (j,))
  ln_ops, ln_specs = ([], []) if ln is None else (list(ln), [whole(c), whole(c)])
  common = dict(block_n=block_n, interpret=interpret, num_warps=num_warps)
  h = _call(functools.partial(_fc1_kernel, affine=ln is not None, eps=eps, block_k=block_k),
            [x, shift, scale, *ln_ops, w1.T, b1], [_rows(c)] * 3 + ln_specs + [cols(c), col],
            rows, f, x.dtype, name='adaln_mlp_fc1', **common)
  gated = gate is not None
  out_cols = pl.BlockSpec((BLOCK_M, block_n), lambda i, j: (i, j))
  out = _call(functools.partial(_fc2_kernel, block_k=block_k),
              [h, w2.T, b2] + ([x, gate] if gated else []), [_rows(f), cols(f), col] + [out_cols] * (2 * gated),
              rows, c, x.dtype, name='adaln_mlp_fc2', **common)
  return out[:m]


def default_block_k(c: int, f: int) -> int:
  """The largest of BLOCK_K_CHOICES dividing C and F (0: none does)."""
  return next((k for k in BLOCK_K_CHOICES if c % k == 0 and f % k == 0), 0)


def unsupported(x, mlp, block_n: int = BLOCK_N, block_k: int = 0) -> str:
  """Why the kernels do not take these shapes ('' when they do); block_k 0: `default_block_k`."""
  (c, f) = mlp[0].shape
  block_k = block_k or default_block_k(c, f)
  if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    return f'x dtype {x.dtype}'
  if not block_k or c % block_k or f % block_k or c % block_n or f % block_n:
    return f'C={c} and F={f} must be multiples of block_k {block_k or 16} and block_n {block_n}'


def _check(x, shift, scale, gate, ln, mlp):
  w1, b1, w2, b2 = mlp
  c, f = x.shape[-1], w1.shape[-1]
  want = {'shift': (shift, x.shape), 'scale': (scale, x.shape), 'gate': (gate, x.shape), 'w1': (w1, (c, f)),
          'b1': (b1, (f,)), 'w2': (w2, (f, c)), 'b2': (b2, (c,))}
  if ln is not None:
    want.update(ln_scale=(ln[0], (c,)), ln_bias=(ln[1], (c,)))
  for name, (a, shape) in want.items():
    if a is not None and a.shape != shape:
      raise ValueError(f'adaln_mlp: {name} must be {shape} for x {x.shape} and w1 {w1.shape}, got {a.shape}')


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _kernel_or_reference(x, shift, scale, gate, ln, mlp, eps, interpret, block_n, block_k, num_warps):
  return _fused(x, shift, scale, gate, ln, mlp, eps, interpret, block_n, block_k, num_warps)


def _fwd(x, shift, scale, gate, ln, mlp, eps, *tiling):
  return _kernel_or_reference(x, shift, scale, gate, ln, mlp, eps, *tiling), (x, shift, scale, gate, ln, mlp)


def _bwd(eps, *rest):
  res, g = rest[-2:]
  return jax.vjp(functools.partial(reference, eps=eps), *res)[1](g)


_kernel_or_reference.defvjp(_fwd, _bwd)


def adaln_mlp(x: jax.Array, shift: jax.Array, scale: jax.Array, gate: Optional[jax.Array],
              ln: Optional[tuple[jax.Array, jax.Array]], mlp: tuple[jax.Array, ...], *, eps: float = 1e-6,
              impl: str = 'auto', block_n: int = BLOCK_N, block_k: int = 0, num_warps: int = 4) -> jax.Array:
  """The block (module docstring): x, shift, scale, gate [..., C] -> [..., C] in x's dtype.

  `impl`: as `dispatch.resolve` ('mosaic' is not built); 'auto' keeps more than AUTO_MAX_ROWS
  rows, and shapes `unsupported` names, on the reference. The tiling (block_k 0: `default_block_k`)
  is for benchmarks."""
  lead = x.shape[:-1]
  flat = lambda a: None if a is None else a.reshape(-1, a.shape[-1])
  x2, shift, scale, gate = flat(x), flat(shift), flat(scale), flat(gate)
  _check(x2, shift, scale, gate, ln, mlp)
  if impl == 'auto' and (x2.shape[0] > AUTO_MAX_ROWS or unsupported(x2, mlp, block_n, block_k)):
    impl = 'reference'
  impl = dispatch.resolve(impl, 'adaln_mlp has no Mosaic GPU kernel')
  if impl == 'reference':
    return reference(x2, shift, scale, gate, ln, mlp, eps).reshape(*lead, -1)
  if why := unsupported(x2, mlp, block_n, block_k):
    raise ValueError(f'adaln_mlp kernel: {why}')
  ln = None if ln is None else tuple(ln)
  block_k = block_k or default_block_k(*mlp[0].shape)
  out = _kernel_or_reference(x2, shift, scale, gate, ln, tuple(mlp), eps, impl == 'interpret', block_n, block_k,
                             num_warps)
  return out.reshape(*lead, -1)
