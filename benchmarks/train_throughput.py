"""Train-step throughput: images/s and MFU of E-CAR and VAR, on one device and data parallel.

  python benchmarks/train_throughput.py --models ecar:B,var:d16 --devices 1,2 --batch_per_device 32

For each model and device count: the compiled train step of `python -m train`
(AdamW, EMA, the non-finite guard, bf16 compute from the config) on a data-parallel
mesh of the first N devices at --batch_per_device images per device, with a
random batch (no input pipeline) and random frozen tokenizers. E-CAR on VAE latents
and MAR read pre-computed posteriors (the latent cache), so the step holds only the
trained model; --encode puts the VAE encoder back into the step. Compile time is
apart. After --warmup steps, --iters steps each waited for (block_until_ready): their median
("synced"), and the median time the call took to return ("dispatch": the host's work before the
device runs it); then --iters steps dispatched back to back, each before the last one ends, as
the trainer runs them: "step ms", images/s and MFU are theirs. MFU = the step's matmul FLOPs
(`var_models.flop_count`, split over the devices) x steps/s over the device's dense bf16 peak.

--count runs nothing: it prints the step's matmul FLOPs as counted on its jaxpr (MFU's numerator)
and as XLA counts them after its optimisations (its cost analysis of the compiled step, which
leaves out cuBLAS/cuDNN calls on a GPU: run it on the CPU with --attn_backend xla), one device.
--losses N prints the first N losses of each model's step on one device, a fixed random batch fed
N times, and times nothing: the numbers two versions of the code must share.
--fit runs nothing either: from XLA's buffer assignment of the step at --batch_per_device and twice
that, the largest batch per device that fits the device's memory pool.
--profile DIR traces one more step of each row and prints where its time goes: each timeline
line's busy time against the step's median, ms per kernel class (GEMMs, attention, reductions,
copies, elementwise, collectives), the top kernels; beside them the step's floors, its matmul FLOPs
at the peak and its state update's bytes at the bandwidth of a device-to-device copy.

Then, for each N > 1, the first --check_steps losses on N devices against one
device at the same global batch, batch_per_device (what one device holds; the N
devices take batch_per_device / N each): the same computation, split over the
mesh, must give the same losses within --rtol.
"""
from __future__ import annotations

import argparse
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from floors import hbm_bandwidth
from sampling import compilation_cache
from timing import kernel_class, line_splits, step_times, trace_events
from train import mesh as mesh_lib
from train import throughput
from train.optimizer import lr_schedule, make_optimizer
from train.state import init_state, sharded_init
from train.step import compile_train_step, make_train_step
from train.tasks import make_task
from var_models import flop_count


def load_config(spec: str, batch: int, overrides: dict):
  """The config of `spec` ('family:variant') at `batch` images per step, with each override
  ('key' or 'parent.key': value, None: left as it is) set."""
  family, variant = spec.split(':')
  config = importlib.import_module(f'configs.{family}').get_config(variant)
  config.train.batch_size = batch
  for key, value in overrides.items():
    *parents, name = key.split('.')
    node = functools.reduce(lambda c, k: c[k], parents, config)
    if value is not None:
      if name not in node:
        raise SystemExit(f'{spec} has no config.{key}')
      node[name] = value
  return config


def config_overrides(args) -> dict:
  return {'dtype': args.dtype, 'attn_backend': args.attn_backend, 'model.scan_blocks': args.scan_blocks or None}


def random_batch(task, batch: int, encode: bool, seed: int) -> dict:
  """{'image' uint8 or 'moments', 'label'} [batch, ...] on the host."""
  rng = np.random.default_rng(seed)
  out = {'label': rng.integers(0, task.num_classes, batch).astype(np.int32)}
  shape = (batch, task.image_size, task.image_size, 3)
  if task.moments is None or encode:
    out['image'] = rng.integers(0, 256, shape, dtype=np.uint8)
  else:
    moments = jax.eval_shape(task.moments, task.frozen, jax.ShapeDtypeStruct(shape, jnp.uint8))
    out['moments'] = rng.standard_normal(moments.shape).astype(np.float32) * 0.5
  return out


def build(config, task, devices: int, batch: dict):
  """(compiled step, state, frozen, global batch, compile seconds) on a mesh of the first `devices`."""
  mesh = mesh_lib.make_mesh(devices, 1, jax.devices()[:devices])
  t = config.train
  schedule = lr_schedule(t)
  tx = make_optimizer(t, schedule)
  state, shardings = sharded_init(task.init, tx, mesh, t.seed)
  frozen = mesh_lib.put(task.frozen, mesh_lib.state_shardings(mesh, task.frozen))
  glob = mesh_lib.global_batch(mesh, batch)
  step, compile_s, flops = compile_train_step(task, tx, schedule, t, mesh, shardings, state, frozen, glob)
  return step, state, frozen, glob, compile_s, flops


def time_steps(config, task, devices: int, per_device: int, args) -> dict:
  """The row of one model and device count; with --profile, one more step traced (`profile_step`)."""
  batch = random_batch(task, per_device * devices, args.encode, 0)
  step, state, frozen, glob, compile_s, flops = build(config, task, devices, batch)
  held = [state]   # donated by each step, replaced by its output

  def call():
    held[0], metrics = step(held[0], frozen, glob)
    return metrics
  ms, metrics = step_times(call, args.warmup, args.iters)
  peak = throughput.peak_flops(jax.devices()[0], args.peak_flops)
  if args.profile:
    profile_step(lambda s: step(s, frozen, glob), held[0], ms['synced'] / 1e3, flops, peak, args,
                 f'{args.profile}/{config.family}_{config.variant}_{devices}')
  seconds = ms['back_to_back'] / 1e3
  return dict(devices=devices, batch=per_device * devices, compile_s=compile_s, synced_ms=ms['synced'],
              dispatch_ms=ms['dispatch'], step_ms=ms['back_to_back'], images_per_s=per_device * devices / seconds,
              mfu=throughput.mfu(flops, 1 / seconds, peak), loss=float(metrics['loss']))


def profile_step(step, state, step_s: float, flops: float, peak, args, logdir: str) -> None:
  """Traces one step(state) on the first device and prints each timeline line's busy time against
  the step's median, its ms per kernel class and top kernels; the host's time before the first
  kernel and after the last, and its longest events; beside them the step's floors: its matmul
  FLOPs at the peak, and the state update's bytes (params, EMA and optimizer state read and
  written, the gradients written and read) at the bandwidth of a device-to-device copy."""
  update = 2 * throughput.bytes_on_device((state.params, state.ema_params, state.opt_state), jax.devices()[0])
  update += 2 * throughput.bytes_on_device(state.params, jax.devices()[0])
  events = trace_events(lambda: jax.block_until_ready(step(state)), logdir)   # donates state
  floors = [f'matmul {flops / peak * 1e3:.2f} ms at the peak' if peak else 'no peak known',
            f'state update {update / 1e9:.2f} GB = {update / args.bandwidth * 1e3:.2f} ms at '
            f'{args.bandwidth / 1e9:.0f} GB/s']
  print(f'  profile, step median {step_s * 1e3:.2f} ms; floors: {", ".join(floors)}', flush=True)
  for line, (busy, span, by_class, by_name) in line_splits(events['device']).items():
    if busy < 0.05 * step_s * 1e3:   # lines of a few launches or markers
      continue
    split = ', '.join(f'{k} {v:.2f} ({100 * v / busy:.0f} %)' for k, v in by_class.most_common())
    print(f'  [{line[:30]}] busy {busy:.2f} ms of a {span:.2f} ms span: {split}', flush=True)
    for name, ms in by_name.most_common(args.profile_top):
      print(f'    {ms:8.2f} ms  {kernel_class(name):10} {name}', flush=True)
  print_host_gaps(events, args.profile_top)


def print_host_gaps(events: dict, top: int) -> None:
  """The traced call's host time before the first kernel starts and after the last one ends, and
  its longest host events (nested events overlap: each is its own duration)."""
  host, device = events['host'], events['device']
  if not host or not device:
    return
  start, end = host[0][2], max(ts + d for _, _, ts, d in host)
  first, last = device[0][2], max(ts + d for _, _, ts, d in device)
  print(f'  host: {(end - start) / 1e3:.2f} ms traced, the first kernel at {(first - start) / 1e3:.2f} ms, the last '
        f'ends {(end - last) / 1e3:.2f} ms before the end', flush=True)
  for line, name, ts, dur in sorted(host, key=lambda e: -e[3])[:top]:
    print(f'    {dur / 1e3:8.2f} ms  at {(ts - start) / 1e3:7.2f} ms  [{line[:24]}] {name[:90]}', flush=True)


def abstract_step(config, task, batch: int, encode: bool):
  """The train step traced on abstract arrays at `batch` images on one device, the state donated
  (nothing allocated but what compiling it needs); `encode`: the VAE encoder in the step."""
  t = config.train
  schedule = lr_schedule(t)
  tx = make_optimizer(t, schedule)
  state = jax.eval_shape(lambda k: init_state(task.init, tx, k), jax.random.key(t.seed))
  frozen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), task.frozen)
  return jax.jit(make_train_step(task, tx, schedule, t.grad_accum, t.ema_decay), donate_argnums=0).trace(
      state, frozen, random_batch(task, batch, encode, 0))


def count_flops(config, task, batch: int, encode: bool) -> tuple[float, float]:
  """(jaxpr matmul FLOPs, XLA's compiled FLOPs) of one step at `batch` images on one device."""
  traced = abstract_step(config, task, batch, encode)
  cost = traced.lower().compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return flop_count.jaxpr_flops(traced.jaxpr.jaxpr), float(cost['flops'])


def step_bytes(config, task, batch: int, encode: bool) -> int:
  """Device bytes of one step at `batch` images on one device, from XLA's buffer assignment: its
  arguments, the outputs that do not reuse a donated argument's buffer, and its temporaries."""
  m = abstract_step(config, task, batch, encode).lower().compile().memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def largest_batch(config, task, batch: int, encode: bool) -> str:
  """The step's bytes at `batch` and 2 x `batch` images, and the largest multiple of 8 images whose
  bytes, on the line through those two, fit the device's memory pool (XLA's temporaries grow in
  proportion to the batch; the state does not)."""
  one, two = step_bytes(config, task, batch, encode), step_bytes(config, task, 2 * batch, encode)
  per_image, fixed = (two - one) / batch, 2 * one - two
  limit = (jax.devices()[0].memory_stats() or {}).get('bytes_limit')
  text = (f'{batch} images {one / 2 ** 30:.2f} GiB, {2 * batch} images {two / 2 ** 30:.2f} GiB: '
          f'{fixed / 2 ** 30:.2f} GiB + {per_image / 2 ** 20:.1f} MiB per image')
  if not limit or per_image <= 0:
    return text
  fits = int((limit - fixed) / per_image) // 8 * 8
  return f'{text}; the pool holds {limit / 2 ** 30:.2f} GiB: at most {fits} images per device'


def first_losses(config, task, devices: int, batch: int, steps: int, encode: bool) -> list[float]:
  step, state, frozen, glob, *_ = build(config, task, devices, random_batch(task, batch, encode, 1))
  losses = []
  for _ in range(steps):
    state, metrics = step(state, frozen, glob)
    losses.append(float(metrics['loss']))
  return losses


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--models', default='ecar:B,var:d16', help='family:variant, comma separated')
  p.add_argument('--devices', default='1', help='device counts, comma separated (data parallel)')
  p.add_argument('--batch_per_device', type=int, default=32)
  p.add_argument('--warmup', type=int, default=3)
  p.add_argument('--iters', type=int, default=10)
  p.add_argument('--check_steps', type=int, default=3)
  p.add_argument('--rtol', type=float, default=2e-2, help='loss tolerance of the N-device check (bf16)')
  p.add_argument('--encode', action='store_true', help='VAE encoder inside the step (no latent cache)')
  p.add_argument('--dtype', default=None, help='override config.dtype')
  p.add_argument('--attn_backend', default=None, help='override config.attn_backend')
  p.add_argument('--scan_blocks', action='store_true', help="E-CAR: the train step's AR and denoiser blocks as "
                                                           'one lax.scan each (config.model.scan_blocks)')
  p.add_argument('--peak_flops', type=float, default=0.0, help='per-device peak FLOP/s (default: by device kind)')
  p.add_argument('--count', action='store_true', help="print the step's FLOPs (jaxpr, XLA), run nothing")
  p.add_argument('--fit', action='store_true', help='print the largest batch per device whose step fits the '
                 "device's memory (two compiles, no step run)")
  p.add_argument('--losses', type=int, default=0, help='print the first N losses on one device, time nothing')
  p.add_argument('--profile', default='', help='trace one more step of each row under this folder and print '
                 'where its time goes beside its floors')
  p.add_argument('--profile_top', type=int, default=15, help='kernels listed per timeline line')
  args = compilation_cache.parse_args(p)
  if args.count or args.fit:
    for spec in args.models.split(','):
      config = load_config(spec, args.batch_per_device, config_overrides(args))
      task = make_task(config)
      if args.fit:
        print(f'{spec}: {largest_batch(config, task, args.batch_per_device, args.encode)}', flush=True)
        continue
      jaxpr, xla = count_flops(config, task, args.batch_per_device, args.encode)
      print(f'{spec}, {args.batch_per_device} images: jaxpr matmul {jaxpr / 1e12:.3f} TFLOP, XLA {xla / 1e12:.3f} '
            f'TFLOP ({jax.devices()[0].device_kind})', flush=True)
    return
  if args.losses:
    for spec in args.models.split(','):
      config = load_config(spec, args.batch_per_device, config_overrides(args))
      losses = first_losses(config, make_task(config), 1, args.batch_per_device, args.losses, args.encode)
      print(f'{spec}, {args.batch_per_device} images: first {args.losses} losses {np.round(losses, 6).tolist()}',
            flush=True)
    return
  counts = [int(n) for n in args.devices.split(',')]
  if max(counts) > jax.device_count():
    raise SystemExit(f'--devices {args.devices}: only {jax.device_count()} devices here')
  if any(args.batch_per_device % n for n in counts):
    raise SystemExit(f'--batch_per_device {args.batch_per_device} must split evenly over --devices {args.devices} '
                     'for the loss check')
  args.bandwidth = hbm_bandwidth(1 << 30) if args.profile else None
  print(f'{jax.devices()[0].device_kind} x {jax.device_count()}, jax {jax.__version__}, '
        f'{args.batch_per_device} images per device, {"images" if args.encode else "cached latents"}')
  print('| model | devices | global batch | compile s | step ms, synced | dispatch ms | step ms, back to back | images/s | MFU | scaling |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |')
  for spec in args.models.split(','):
    config = load_config(spec, args.batch_per_device, config_overrides(args))
    task = make_task(config)
    base = None
    for n in counts:
      row = time_steps(config, task, n, args.batch_per_device, args)
      base = base or row['images_per_s'] / n
      mfu = '-' if row['mfu'] is None else f'{100 * row["mfu"]:.1f} %'
      print(f'| {spec} | {n} | {row["batch"]} | {row["compile_s"]:.1f} | {row["synced_ms"]:.1f} | '
            f'{row["dispatch_ms"]:.1f} | {row["step_ms"]:.1f} | '
            f'{row["images_per_s"]:.1f} | {mfu} | {row["images_per_s"] / base:.2f} |', flush=True)
    for n in (c for c in counts if c > 1):
      one = first_losses(config, task, 1, args.batch_per_device, args.check_steps, args.encode)
      many = first_losses(config, task, n, args.batch_per_device, args.check_steps, args.encode)
      ok = np.allclose(many, one, rtol=args.rtol)
      print(f'{spec}: first losses, 1 device {np.round(one, 5).tolist()} vs {n} devices '
            f'{np.round(many, 5).tolist()}: {"equal" if ok else "DIFFERENT"} within rtol {args.rtol}', flush=True)


if __name__ == '__main__':
  main()
