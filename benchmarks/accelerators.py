"""Accelerated samplers against our own unaccelerated ones, side by side in one process.

  python benchmarks/accelerators.py --models infinity_2b,d30 --batches 1,8 --profile /tmp/accel_prof
  python benchmarks/accelerators.py --mar_sizes base,huge --ecar_sizes L --batches 1,16 --iters 3 --warmup 1

Models (random weights, official init; VAR weights stored in bf16, bf16 compute, cuDNN
attention on both sides; cfg 1.5, top-k 900, top-p 0.96):
  infinity_2b -- a VAR of Infinity-2B's transformer shape (depth 32, width 2048, 16 heads, head
                 dim 128) on the 13-scale 1024 px schedule, with VAR's 4096-code head and its
                 VQVAE decoding 1024 px (Infinity's bitwise tokenizer and text encoder are not
                 ported); FastVAR's, LazyVAR's and SparVAR's Infinity presets;
  infinity_8b -- the same at Infinity-8B's shape (depth 40, width 3584, 28 heads); SparVAR with
                 and without skip-2, and skip-2 alone;
  d30         -- VAR-d30 at 256 px; their var256 presets;
  smoke       -- a 2-block VAR at 256 px, for checking this script on a CPU (--attn xla).
--scan on / both: the VAR samplers with each scale's runs of alike blocks (no hooks, or a
policy's hooks of one scan group) as one `lax.scan` (`make_sampler(..., scan_blocks=True)`), and
the MAR samplers with their encoder's and decoder's, the E-CAR samplers with their AR's and
denoisers' (config.sample.scan_blocks), as rows 'spec@scan'. --xla 'a=1;b=true': every sampler
compiled again under each set of XLA options, as rows 'spec xla1', 'spec xla2', ... (the first
set, '' by default, is XLA's defaults; a list value stays whole:
';xla_gpu_enable_command_buffer=FUSION,CUBLAS'). --layer_dense_max_rows N: scanned blocks' dense
layers run `pallas_kernels.layer_dense`'s kernel up to N rows in this process (its AUTO_MAX_ROWS
otherwise); compare two such runs by their scanned / unrolled ratios. --layer_dense_mosaic_rows N:
from N rows they run its Mosaic GPU kernel on Hopper (its AUTO_MOSAIC_MIN_ROWS otherwise).
Every sampler is lowered in turn and compiled in a pool of --compile_workers threads (compile
seconds are each program's own wall time, under that contention), then, after --wait_for
exists (so the compiles can overlap other GPU work), each is timed alone: medians of --iters
calls after --warmup calls, a fresh key per call, timed on the host after block_until_ready.
'decoder' is the VQVAE decoder (f_hat -> image) compiled and timed alone at the same batch;
'no decoder' = the sampler's median - the decoder's (the papers time without it). Peak memory
is XLA's buffer assignment of the compiled program (weights, temporaries, outputs). The MAR and
E-CAR rows name each sampler's memory floor (`floors.sampler_reads`: LazyMAR's head steps read no
weights of the blocks they skip and only the adaLN gates of those whose MLP output they reuse) and
traffic floor (the weights the program at that batch reads: those its loops use alike at every
step, once a loop) at the bandwidth a --copy_bytes copy reaches after the compiles.
--profile traces one call of each sampler at the first batch and splits its kernels into GEMMs,
attention (per scale, where one kernel runs per scale and block), convolutions and the rest:
the baseline's split is every accelerator's ceiling.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import itertools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sampling import compilation_cache
from accel.fidelity import file_name, peak_bytes
from accel.lazymar_flops import lazymar_sampling_flops, official_extra
from accel.specs import policy_from_spec, split_specs
from accel.timing import compile_in
import floors
from timing import (call_times, device_gap_summary, kernel_class, line_splits, print_top_device_ops, settings,
                    trace_events, xla_variants)
from var_models.flop_count import flops
from var_models.mar import model as mar_model
from var_models.mar.flops import sampling_flops
from var_models.nn.init import compiled_init
from var_models.tokenizers.autoencoder_kl import KL16
from var_models.tokenizers.vqvae import VQVAE, VQVAEConfig
from var_models.var.from_config import init_var_params
from var_models.var.model import VARConfig
from var_models.var.policy import var_binding
from var_models.var.sampler import make_sampler
from var_models.var.schedules import INFINITY_1024, VAR_256

# The module (its name in the package is the function's).
layer_dense_module = importlib.import_module('pallas_kernels.layer_dense')

LAZYVAR_INFINITY = ('infinity_2b', 'no_pgd', 'no_cum', 'group5', 'keep40_20', 'keep0_0')
SPARVAR_INFINITY = ('infinity_2b', 'infinity_2b_table4', 'cs4a_only', 'cs4a_no_cache', 'csla_only')
MODELS = {
    'infinity_2b': (dict(depth=32, width=2048, num_heads=16, patch_nums=INFINITY_1024.patch_nums),
                    dict(patch_nums=INFINITY_1024.patch_nums),
                    ('fastvar:infinity_2b', 'fastvar:hart') + tuple(f'lazyvar:{p}' for p in LAZYVAR_INFINITY)
                    + tuple(f'sparvar:{p}' for p in SPARVAR_INFINITY)
                    + ('fastvar:skip2', 'fastvar:skip2+sparvar:skip2')),
    'infinity_8b': (dict(depth=40, width=3584, num_heads=28, patch_nums=INFINITY_1024.patch_nums),
                    dict(patch_nums=INFINITY_1024.patch_nums),
                    ('sparvar:infinity_8b', 'fastvar:skip2', 'fastvar:skip2+sparvar:skip2')),
    'd30': (dict(depth=30), dict(), ('fastvar:var256', 'lazyvar:var256', 'sparvar:var256')),
    'smoke': (dict(depth=2, width=64, num_heads=2, vocab_size=64, cvae=8, num_classes=10),
              dict(vocab_size=64, z_channels=8, ch=32, num_res_blocks=1, patch_nums=VAR_256.patch_nums),
              ('fastvar:var256', 'sparvar:var256')),
}
OPTS = dict(cfg=1.5, top_k=900, top_p=0.96)


def fitting(specs: list[str], var_cfg: VARConfig) -> tuple[str, ...]:
  """The specs whose policies fit the model's schedule and depth."""
  def fits(spec):
    try:
      policy_from_spec(spec).bind(var_binding(var_cfg))
      return True
    except ValueError:
      return False
  return tuple(s for s in specs if fits(s))


def build(model: str, attn: str, policies: str):
  """(var_cfg, vq_cfg, params with the VAR weights in bf16, policy specs) of a model."""
  var_kw, vq_kw, specs = MODELS[model]
  var_cfg = VARConfig(**var_kw, attn_backend=attn, dtype=jnp.bfloat16)
  vq_cfg = VQVAEConfig(**vq_kw, dtype=jnp.bfloat16)
  if policies:
    specs = fitting(split_specs(policies), var_cfg)
  return var_cfg, vq_cfg, _init_params(var_cfg, vq_cfg), specs


def _init_params(var_cfg: VARConfig, vq_cfg: VQVAEConfig):
  """Random parameters, the VAR's in bf16, made by one compiled program (`compiled_init`)."""
  def init(key):
    params = init_var_params(var_cfg, vq_cfg, key)
    return {**params, 'var': jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params['var'])}
  return compiled_init(init, jax.random.key(0))


# --scan -> the suffixes of the sampler names it times ('@scan': blocks scanned).
SCAN_MODES = {'off': ('',), 'on': ('@scan',), 'both': ('', '@scan')}


def sampler_names(specs: tuple[str, ...], scan: str, variants: int = 1) -> tuple[str, ...]:
  """The samplers of a model: the baseline and each spec, unrolled (`spec`), with their blocks
  scanned (`spec@scan`), or both (--scan off / on / both), the unrolled baseline first; each
  compiled under every set of --xla options after the first too (`spec@scan xla1`, ...)."""
  return tuple(spec + mode + (f' xla{k}' if k else '') for k in range(variants) for mode in SCAN_MODES[scan]
               for spec in ('baseline',) + specs)


def layouts(var_cfg, vq_cfg, params, scan: str) -> dict:
  """{'': params, 'scan': params as the scanned samplers read them (`prepare`: the blocks stacked)},
  each only where --scan (`scan`) times such samplers: what `sampler_job` takes."""
  return {mode[1:]: make_sampler(var_cfg, vq_cfg, scan_blocks=bool(mode)).prepare(params)
          for mode in SCAN_MODES[scan]}


def sampler_job(var_cfg, vq_cfg, params, name: str, batch: int):
  """(lowered sampler, args maker) of one sampler (`sampler_names`) at one batch; params: `layouts`."""
  spec, _, scan = name.split(' ')[0].partition('@')
  sample = make_sampler(var_cfg, vq_cfg, policy_from_spec(spec), scan_blocks=bool(scan))
  params = params[scan]
  labels = np.arange(batch, dtype=np.int32) % var_cfg.num_classes
  lab, cfg = jnp.asarray(labels), jnp.float32(OPTS['cfg'])
  opts = dict(OPTS, top_k=min(OPTS['top_k'], var_cfg.vocab_size))   # the smoke model has 64 codes
  return sample.lower(params, jax.random.key(0), labels, **opts), lambda i: (params, jax.random.key(i), lab, cfg)


def decoder_job(vq_cfg, params, batch: int):
  hw = vq_cfg.patch_nums[-1]
  f_hat = jax.random.normal(jax.random.key(1), (batch, hw, hw, vq_cfg.z_channels))
  decode = jax.jit(lambda p, f: VQVAE(vq_cfg).apply({'params': p}, f, method=VQVAE.fhat_to_img))
  return decode.lower(params['vqvae'], f_hat), lambda i: (params['vqvae'], f_hat + i)


def time_calls(compiled, make_args, warmup: int, iters: int) -> float:
  """Median ms of `iters` calls after `warmup` calls."""
  return statistics.median(call_times(compiled, make_args, warmup, iters)) * 1e3


def profile_split(compiled, make_args, logdir: str, num_scales: int, depth: int) -> list[str]:
  """The device's idle gaps (`device_gap_summary`), then per timeline line: ms per kernel class, and
  attention per scale when the line holds one attention kernel per (scale, block) (in time order)."""
  traced = trace_events(lambda: jax.block_until_ready(compiled(*make_args(7))), logdir)
  events, out = traced['device'], [device_gap_summary(traced)]
  for line, (busy, span, by_class, by_name) in line_splits(events).items():
    text = ', '.join(f'{k} {v:.2f}' for k, v in by_class.most_common())
    out.append(f'  [{line[:40]}] busy {busy:.2f} ms of a {span:.2f} ms span: {text}')
    attn = [dur / 1e3 for ln, name, _, dur in events if ln == line and kernel_class(name) == 'attention']
    if len(attn) == num_scales * depth:
      per = [sum(attn[s * depth:(s + 1) * depth]) for s in range(num_scales)]
      out.append('    attention per scale, ms: ' + ' '.join(f'{p:.2f}' for p in per))
    out.extend(f'    {ms:8.2f} ms  {kernel_class(n):10} {n}' for n, ms in by_name.most_common(12))
  return out


def wait_for(path: str) -> None:
  if path:
    print(f'waiting for {path} before timing', flush=True)
    while not os.path.exists(path):
      time.sleep(2)


def lower_and_compile(args, batches):
  """(models {name: build(...)}, makers {(model, batch, name): args maker}, compiled {...: (program,
  compile s)}) of the decoder, the baseline and each policy per model and batch."""
  models, makers, futures, variants = {}, {}, [], xla_variants(args.xla)
  with concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
    for model in args.models.split(','):
      var_cfg, vq_cfg, params, specs = models[model] = build(model, args.attn, args.policies)
      layout = layouts(var_cfg, vq_cfg, params, args.scan)
      for batch in batches:
        jobs = [('decoder', lambda: decoder_job(vq_cfg, params, batch))]
        jobs += [(name, lambda name=name: sampler_job(var_cfg, vq_cfg, layout, name, batch))
                 for name in sampler_names(specs, args.scan, len(variants))]
        for name, job in jobs:
          lowered, makers[model, batch, name] = job()
          options = variants[int(name.partition(' xla')[2] or 0)]
          futures.append(compile_in(pool, (model, batch, name), lowered, options))
    print(f'lowered {len(futures)} programs', flush=True)
    compiled = dict(f.result() for f in futures)
  print('compiled', flush=True)
  return models, makers, compiled


def time_samplers(model, batch, specs, compiled, makers, dec_ms, args) -> list[dict]:
  """One row per sampler (the baseline first), printed as it is measured."""
  rows, base_ms = [], None
  for spec in specs:
    prog, compile_s = compiled[model, batch, spec]
    ms = time_calls(prog, makers[model, batch, spec], args.warmup, args.iters)
    base_ms = base_ms or ms
    row = dict(model=model, batch=batch, policy=spec, compile_s=compile_s, ms=ms, decoder_ms=dec_ms,
               no_decoder_ms=ms - dec_ms, speedup=base_ms / ms, speedup_no_decoder=(base_ms - dec_ms) / (ms - dec_ms),
               peak_mib=(peak_bytes(prog) or 0) / 2 ** 20)
    rows.append(row)
    print(f"{model:12} B={batch:<2} {spec:22} compile {compile_s:6.1f} s  {ms:9.2f} ms  no decoder "
          f"{row['no_decoder_ms']:9.2f} ms  x{row['speedup']:.2f} / x{row['speedup_no_decoder']:.2f}  "
          f"peak {row['peak_mib']:8.0f} MiB", flush=True)
  return rows


def print_table(rows: list[dict]) -> None:
  print('\n| model | batch | policy | ms | decoder ms | ms without decoder | speed-up | speed-up without decoder '
        '| peak MiB | compile s |\n' + '| --- ' * 10 + '|')
  for r in rows:
    print(f"| {r['model']} | {r['batch']} | {r['policy']} | {r['ms']:.2f} | {r['decoder_ms']:.2f} | "
          f"{r['no_decoder_ms']:.2f} | {r['speedup']:.2f}x | {r['speedup_no_decoder']:.2f}x | {r['peak_mib']:.0f} | "
          f"{r['compile_s']:.1f} |")


def flop_table(args) -> None:
  """--flops: matmul FLOPs per image of the baseline and each policy at batch 1, counted on the
  sampler's jaxpr from shapes alone (`var_models.flop_count`, 2 per multiply-add; no GPU)."""
  print('| model | policy | TFLOPs / image | without decoder |\n| --- | --- | ---: | ---: |', flush=True)
  key, labels, scale = (jax.eval_shape(lambda: jax.random.key(0)), jax.ShapeDtypeStruct((1,), jnp.int32),
                        jax.ShapeDtypeStruct((), jnp.float32))
  for model in args.models.split(','):
    var_kw, vq_kw, specs = MODELS[model]
    var_cfg = VARConfig(**var_kw, attn_backend='xla', dtype=jnp.bfloat16)
    vq_cfg = VQVAEConfig(**vq_kw, dtype=jnp.bfloat16)
    specs = fitting(split_specs(args.policies), var_cfg) if args.policies else specs
    params = jax.eval_shape(lambda k: init_var_params(var_cfg, vq_cfg, k), jax.random.key(0))
    hw = vq_cfg.patch_nums[-1]
    decoder = flops(lambda p, f: VQVAE(vq_cfg).apply({'params': p}, f, method=VQVAE.fhat_to_img), params['vqvae'],
                    jax.ShapeDtypeStruct((1, hw, hw, vq_cfg.z_channels), jnp.float32))
    top = dict(top_k=min(OPTS['top_k'], var_cfg.vocab_size), top_p=OPTS['top_p'])
    for spec in ('baseline',) + specs:
      sample = make_sampler(var_cfg, vq_cfg, policy_from_spec(spec))
      total = flops(lambda p, k, l, c, sample=sample: sample._sample(p, k, l, c, **top), params, key, labels, scale)
      print(f'| {model} | {spec} | {total / 1e12:.2f} | {(total - decoder) / 1e12:.2f} |', flush=True)


# LazyMAR's paper, 64 iterations: MAR's TFLOPs, and LazyMAR's with its 'Speed', which is the FLOPs ratio but
# for the token-cache row (69.06 / 44.21 = 1.56): Table 1 (every cache) for B, L, H; Table 2's MAR-H
# ablations, 'token cache' beside our decoder_only and 'condition cache' beside condition_only.
PAPER_MAR = {'base': 15.49, 'large': 35.05, 'huge': 69.06}
PAPER_LAZYMAR = {('base', 'official'): (5.54, 2.80), ('large', 'official'): (12.52, 2.80),
                 ('huge', 'official'): (24.38, 2.83), ('huge', 'decoder_only'): (44.21, 1.59),
                 ('huge', 'condition_only'): (36.80, 1.87)}


def mar_flop_table(args) -> None:
  """--flops --mar_sizes: model FLOPs per image without the VAE decoder (64 iterations, 100 head steps, CFG)
  of MAR (`var_models.mar.flops`) and each LazyMAR preset (`accel.lazymar_flops`), the ratio over MAR; beside
  them the count of the official code's way of computing the same caches (+ `official_extra`) and the
  paper's row."""
  print('| model | policy | TFLOPs / image without decode | ratio | official code: TFLOPs | ratio '
        '| paper: TFLOPs | ratio | Speed |\n' + '| --- ' * 9 + '|', flush=True)
  for size in args.mar_sizes.split(','):
    cfg = getattr(mar_model, size)()
    base, paper_base = sampling_flops(cfg, KL16)['per_image_without_decode'], PAPER_MAR.get(size)
    print(f"| MAR-{size} | baseline | {base / 1e12:.2f} | 1.00x | | | {paper_base or ''} | | |", flush=True)
    for preset in split_specs(args.mar_presets):
      policy = policy_from_spec(f'lazymar:{preset}', 'mar')
      ours = lazymar_sampling_flops(cfg, KL16, policy)['per_image_without_decode']
      official = ours + official_extra(cfg, policy)
      paper = PAPER_LAZYMAR.get((size, preset))
      paper = f'{paper[0]:.2f} | {paper_base / paper[0]:.2f}x | {paper[1]:.2f}x' if paper else ' | |'
      print(f'| MAR-{size} | {preset} | {ours / 1e12:.2f} | {base / ours:.2f}x | {official / 1e12:.2f} | '
            f'{base / official:.2f}x | {paper} |', flush=True)


MAR_PRESETS = ('official', 'encoder_only', 'decoder_only', 'condition_only', 'head_only')
ECAR_PRESETS = ('every_2', 'every_3', 'every_5', 'last_every_3')


# The sampling settings of the family rows: MAR 64 iterations, 100 diffusion steps, cfg 3.0 (linear);
# E-CAR 250 Euler steps, cfg 1.5.
FAMILY_OVERRIDES = {'mar': dict(cfg=3.0, num_iter=64, num_steps=100), 'ecar': dict(cfg=1.5, num_steps=250)}


def family_config(family: str, size: str, dtype: str, attn: str):
  """configs/{family}.py's `size` with compute `dtype` (float32 parameters) and attention backend `attn`."""
  config = importlib.import_module(f'configs.{family}').get_config(size)
  config.dtype, config.attn_backend = dtype, attn
  return config


def family_configs(args) -> list[tuple[str, object, tuple[str, ...]]]:
  """(label, config, policy specs) of each --mar_sizes and --ecar_sizes model (`family_config`, bf16
  compute by default, cudnn attention)."""
  out = []
  for sizes, family, method, presets, label in (
      (args.mar_sizes, 'mar', 'lazymar', args.mar_presets, 'MAR-{}'),
      (args.ecar_sizes, 'ecar', 'ecarcache', args.ecar_presets, 'E-CAR-{}')):
    for size in filter(None, sizes.split(',')):
      config = family_config(family, size, args.family_dtype, args.attn)
      out.append((label.format(size), config, tuple(f'{method}:{p}' for p in split_specs(presets))))
  return out


def family_layouts(config, scan: str, overrides: dict):
  """(family with random parameters, {'': make, 'scan': make} of its samplers unrolled and scanned,
  {'': params, 'scan': params} as each reads them, only where --scan (`scan`) times such samplers):
  what `family_job` takes. `overrides`: settings over FAMILY_OVERRIDES."""
  from sampling import family_from_config, sampling_from_config   # pylint: disable=import-outside-toplevel
  overrides = {**FAMILY_OVERRIDES[config.family], **overrides}
  family = family_from_config(config, overrides=overrides)
  makes = {'': family.make, 'scan': sampling_from_config(config, {**overrides, 'scan_blocks': True}).make}
  params = {mode[1:]: makes[mode[1:]]().prepare(family.params) for mode in SCAN_MODES[scan]}
  return family, makes, params


def family_job(family, makes, params, name: str, batch: int):
  """(sampler, lowered sampler, args maker) of one sampler (`sampler_names`) at one batch."""
  spec, _, scan = name.split(' ')[0].partition('@')
  sample = makes[scan](policy_from_spec(spec, family.name))
  labels = np.arange(batch, dtype=np.int32) % family.num_classes
  def arguments(i):
    return sample.arguments(params[scan], jax.random.key(i), labels, **family.opts)
  return sample, sample.lower(params[scan], jax.random.key(0), labels, **family.opts), arguments


def family_main(args) -> None:
  """--mar_sizes / --ecar_sizes: LazyMAR against our MAR baseline (64 iterations, 100 diffusion steps,
  cfg 3.0 on the linear schedule, the KL-16 decoder included) and E-CAR's condition cache against the
  E-CAR baseline (250 Euler steps, cfg 1.5, the VAE decoder included), random weights (official init),
  per model and batch the baseline and each preset: compiled in a pool, then timed alone as the VAR
  rows (medians of --iters calls after --warmup)."""
  batches = [int(b) for b in args.batches.split(',')]
  makers, reads, futures, order, xla = {}, {}, [], [], xla_variants(args.xla)
  with concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
    variants = args.family_overrides.split(';')
    for (label, config, specs), variant in itertools.product(family_configs(args), variants):
      family, makes, params = family_layouts(config, args.scan, settings(variant))
      label = f'{label} {variant}' if len(variants) > 1 else label
      for batch, name in itertools.product(batches, sampler_names(specs, args.scan, len(xla))):
        sample, lowered, makers[label, batch, name] = family_job(family, makes, params, name, batch)
        reads[label, batch, name] = tuple(floors.sampler_reads(sample, family.params, args.family_dtype, b)
                                          for b in (None, batch))
        futures.append(compile_in(pool, (label, batch, name), lowered, xla[int(name.partition(' xla')[2] or 0)]))
        order.append((label, batch, name))
    compiled = dict(f.result() for f in futures)
  wait_for(args.wait_for)
  bandwidth = floors.hbm_bandwidth(args.copy_bytes)
  print(f'\nHBM bandwidth (a {args.copy_bytes / 2**30:g} GiB copy): {bandwidth / 1e9:.0f} GB/s\n'
        '| model | batch | policy | ms / batch | speed-up | memory floor ms | x floor | traffic floor ms | x traffic '
        '| peak MiB | compile s |\n' + '| --- ' * 11 + '|', flush=True)
  rows, base_ms = [], {}
  for label, batch, spec in order:
    prog, compile_s = compiled[label, batch, spec]
    ms = time_calls(prog, makers[label, batch, spec], args.warmup, args.iters)
    base = base_ms.setdefault((label, batch), ms)
    floor_ms, traffic_ms = (floors.floor(r, bandwidth)['seconds'] * 1e3 for r in reads[label, batch, spec])
    rows.append(dict(model=label, batch=batch, policy=spec, ms=ms, speedup=base / ms, floor_ms=floor_ms,
                     traffic_floor_ms=traffic_ms, peak_mib=(peak_bytes(prog) or 0) / 2 ** 20, compile_s=compile_s))
    print(f"| {label} | {batch} | {spec} | {ms:.1f} | {base / ms:.2f}x | {floor_ms:.1f} | {ms / floor_ms:.2f}x | "
          f"{traffic_ms:.1f} | {ms / traffic_ms:.2f}x | {rows[-1]['peak_mib']:.0f} | {compile_s:.1f} |", flush=True)
    if args.profile and batch == batches[0]:
      print_top_device_ops(lambda: jax.block_until_ready(prog(*makers[label, batch, spec](7))),
                           os.path.join(args.profile, file_name(f'{label}_b{batch}_{spec}')))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=1)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--models', default='infinity_2b,d30')
  ap.add_argument('--batches', default='1,8')
  ap.add_argument('--attn', default='cudnn')
  ap.add_argument('--policies', default='', help="specs; each model runs those that fit it (default: the "
                  "model's presets)")
  ap.add_argument('--scan', default='off', choices=('off', 'on', 'both'),
                  help="VAR and MAR samplers with their blocks scanned ('spec@scan' rows), unrolled, or both")
  ap.add_argument('--xla', default='', help="';'-separated sets of XLA options ('a=1,b=true'), each compiling "
                  "every sampler apart (rows 'spec xla1', ...; '' is XLA's defaults)")
  ap.add_argument('--warmup', type=int, default=2)
  ap.add_argument('--iters', type=int, default=10)
  ap.add_argument('--compile_workers', type=int, default=8)
  ap.add_argument('--wait_for', default='', help='a file to wait for between compiling and timing')
  ap.add_argument('--profile', default='', help='trace one call of each sampler at the first batch under this folder')
  ap.add_argument('--json', default='', help='also write the rows here')
  ap.add_argument('--flops', action='store_true', help='count FLOPs per image instead of timing (no GPU needed; '
                  'VAR models, or with --mar_sizes LazyMAR)')
  ap.add_argument('--mar_sizes', default='', help='MAR sizes (base, large, huge): time (or --flops: count) LazyMAR '
                  'instead of VAR')
  ap.add_argument('--mar_presets', default=','.join(MAR_PRESETS), help='LazyMAR presets beside the MAR baseline')
  ap.add_argument('--ecar_sizes', default='', help="E-CAR sizes (S, B, L): time E-CAR's condition cache "
                  'instead of VAR')
  ap.add_argument('--ecar_presets', default=','.join(ECAR_PRESETS), help='ECARConditionCache presets')
  ap.add_argument('--family_overrides', default='', help="sampling settings of every MAR and E-CAR sampler "
                  "('key=value,...', e.g. 'encoder_sizes=0'); ';'-separated sets compile and time each set's rows")
  ap.add_argument('--family_dtype', default='bfloat16', help='compute dtype of the MAR and E-CAR models')
  ap.add_argument('--copy_bytes', type=int, default=1 << 31,
                  help="size of the copy that measures HBM bandwidth (the MAR and E-CAR rows' memory floors)")
  ap.add_argument('--layer_dense_mosaic_rows', type=int, default=layer_dense_module.AUTO_MOSAIC_MIN_ROWS,
                  help="rows from which a scanned block's dense layers run layer_dense's Mosaic GPU kernel "
                  'on Hopper (0: never, the Triton kernel)')
  ap.add_argument('--layer_dense_max_rows', type=int, default=0,
                  help="rows up to which a scanned block's dense layers run pallas_kernels.layer_dense's kernel "
                  f'(0: its AUTO_MAX_ROWS, {layer_dense_module.AUTO_MAX_ROWS}; above, XLA\'s GEMM of a copy)')
  args = compilation_cache.parse_args(ap)
  if args.layer_dense_max_rows:
    layer_dense_module.AUTO_MAX_ROWS = args.layer_dense_max_rows
  layer_dense_module.AUTO_MOSAIC_MIN_ROWS = args.layer_dense_mosaic_rows
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}; layer_dense kernel up to '
        f'{layer_dense_module.AUTO_MAX_ROWS} rows, Mosaic GPU from {args.layer_dense_mosaic_rows or "none"}',
        flush=True)
  if args.flops and args.ecar_sizes:
    ap.error('--flops counts VAR and MAR models, not E-CAR')
  if args.flops and args.mar_sizes:
    mar_flop_table(args)
    return
  if args.mar_sizes or args.ecar_sizes:
    family_main(args)
    return
  if args.flops:
    flop_table(args)
    return
  batches = [int(b) for b in args.batches.split(',')]
  models, makers, compiled = lower_and_compile(args, batches)
  wait_for(args.wait_for)
  rows, notes = [], []
  for model, batch in itertools.product(models, batches):
    var_cfg, _, _, specs = models[model]
    dec_prog, dec_compile = compiled[model, batch, 'decoder']
    dec_ms = time_calls(dec_prog, makers[model, batch, 'decoder'], args.warmup, args.iters)
    names = sampler_names(specs, args.scan, len(xla_variants(args.xla)))
    rows += time_samplers(model, batch, names, compiled, makers, dec_ms, args)
    for spec in names if args.profile and batch == batches[0] else ():
      split = [f'{model} B={batch} {spec} profile (decoder alone {dec_ms:.2f} ms, compile {dec_compile:.1f} s):']
      split += profile_split(compiled[model, batch, spec][0], makers[model, batch, spec],
                             os.path.join(args.profile, file_name(f'{model}_b{batch}_{spec}')),
                             var_cfg.schedule.num_scales, var_cfg.depth)
      notes += split
      print('\n'.join(split), flush=True)
  print_table(rows)
  print('\n'.join(notes), flush=True)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=1)

if __name__ == '__main__':
  main()
