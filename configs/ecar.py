"""E-CAR configs: `--config configs/ecar.py:VARIANT`, VARIANT in S, B, L (the paper's E-CAR-S/B/L),
S_no_ar, B_no_ar, L_no_ar (its section 4.5 ablation), S_patch1, B_patch1, L_patch1 (a costlier
ablation of ours), tiny, tiny_no_ar.

What the paper fixes: ImageNet 256 px in the SDXL VAE's latent space (f8, 4 channels, scaling
0.13025), 3 stages on latent grids 8, 16, 32; Table 1's AR (layers 10 / 20 / 24, width 768 /
1024 / 1152, heads 6 / 16 / 16); Table 2's parameters (155M / 511M / 854M) and sampling FLOPs
with CFG (1T / 3.2T / 5.8T); 250 Euler steps, a third per stage; denoisers "with much fewer
layers than the AR". What it leaves to us: the patch size, the denoisers' width and depth.

The FLOP convention, calibrated on MAR (var_models.mar.flops counts the official MAR sampling:
64 iterations, 100 head steps, CFG): 2 FLOPs per multiply-add, VAE decoder excluded, gives
MAR-B / L / H 14.7T / 33.1T / 65.2T against Table 2's 18T / 34T / 60T (-19 %, -3 %, +9 %; no
weighting of MAR's parts puts all three within 10 %: tests/test_mar_flops.py); one
FLOP per multiply-add would give half, 41-59 % below every row. (Table 2's DiT-XL/2 row, 60T,
is DiT's own 118.6 GFLOPs, multiply-adds, x 250 steps x 2: copied, not counted the same way.)
`ecar.sampling_flops` counts E-CAR in that convention.

The choice. FLOPs of the denoisers are about 2 x 2 (CFG) x 83 steps x their parameters x
their tokens per stage, so at fixed parameters only the token counts move them. Patch size 1
(1344 tokens) costs 12T / 40T / 73T: 8-13x Table 2 (the `*_patch1` variants). Patch 4 on every
stage gives token maps 2x2, 4x4, 8x8 (doubling per stage, as the paper's token maps do) and
lands near Table 2 once the denoisers, as wide as the AR with its heads, put most layers on the
finest stage (layers per stage 1-3-3 / 3-4-6 / 5-6-8):
    params 154.2M / 512.5M / 855.5M  (-0.5 %, +0.3 %, +0.2 % of Table 2)
    FLOPs  0.93T  / 3.05T  / 5.22T   (-7.2 %, -4.7 %, -10.0 %; with the decoder 1.56 / 3.68 / 5.85T)
(tests/test_ecar_config.py pins both.)

`*_no_ar` is the paper's ablation (section 4.5): the AR layers move into the denoisers
(ar_depth 0; each stage's denoiser gets ar_depth / S more layers, so the layer total stays),
and each stage is conditioned on the class alone. Figure 6's loss curves on the built-in data:
    python -m train --config configs/ecar.py:tiny --workdir runs/fig6_ar
    python -m train --config configs/ecar.py:tiny_no_ar --workdir runs/fig6_no_ar
and compare the two runs' `loss` in TensorBoard (`tensorboard --logdir runs`).
`tiny` trains on a CPU in minutes: pixel space, 32 px, stages 8/16/32, patch 4 (4 + 16 + 64 tokens).

Precision: the paper trained with float32 parameters and TF32 matmuls (A100s). The paper presets
do the same: `dtype='float32'`, and XLA's default matmul precision on NVIDIA GPUs runs float32
matmuls in TF32. `--config.dtype=bfloat16` computes in bfloat16 (parameters stay float32).

`train`: the paper's settings (section 4.1): AdamW, lr 1e-4, no weight decay,
batch 256, 400K iterations (E-CAR-L: 800K). The paper is silent on warm-up,
clipping and EMA: none, none and the usual 0.9999. `flow`: Pyramid Flow's
(gamma 1/3, stage boundaries on a 1000-step grid); `time_windows` 'uniform' is
E-CAR's equal partition of the time interval. `gradnorm`: Chen et al.'s
alpha 1.5, on the AR's final LayerNorm (the last layer all stages share); the
weights' own Adam learning rate (1e-3; 1e-2 for tiny's short runs) is ours.
`sample`: 250 Euler steps in all, a third per stage
(the paper's evaluation); the paper gives no CFG scale: 1.5 (DiT's FID setting);
scan_blocks: the AR's and each denoiser's blocks as one lax.scan (compiles once
per run of blocks; benchmarks/RESULTS.md has its run time). `model.scan_blocks`: the
same for the train step (one block compiled per stack; the parameters unchanged); off,
since E-CAR-B's step on an H200 then compiles in 48 s against 60 but runs 1.36x longer.
`vae_ckpt` names the frozen SDXL VAE (`python -m var_models.convert sdxl-vae`);
empty = random.
"""
import ml_collections

from configs import common

VARIANTS = ('S', 'B', 'L', 'S_no_ar', 'B_no_ar', 'L_no_ar', 'S_patch1', 'B_patch1', 'L_patch1', 'tiny',
            'tiny_no_ar')
# AR depth, width, heads (Table 1); denoiser layers per stage; training iterations.
_SIZES = {'S': (10, 768, 6, (1, 3, 3), 400_000), 'B': (20, 1024, 16, (3, 4, 6), 400_000),
          'L': (24, 1152, 16, (5, 6, 8), 800_000)}
# The patch-1 ablation's denoisers: 2 / 4 / 6 layers on every stage (benchmarks/RESULTS.md, "E-CAR patch-1 sampling").
_PATCH1_DEPTHS = {'S': 2, 'B': 4, 'L': 6}


def _paper(variant: str, patch_size: int = 4) -> ml_collections.ConfigDict:
  depth, width, heads, den_depth, steps = _SIZES[variant]
  if patch_size == 1:
    den_depth = _PATCH1_DEPTHS[variant]
  c = ml_collections.ConfigDict()
  c.family = 'ecar'
  c.variant = variant
  c.image_size = 256
  c.num_classes = 1000
  c.latent_space = 'vae'         # 'vae' (SDXL latents) or 'pixel'
  c.vae = ml_collections.ConfigDict(dict(
      embed_dim=4, z_channels=4, ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, encoder_attn=False,
      decoder_attn=False, mid_attn=True, scaling_factor=0.13025))
  c.model = ml_collections.ConfigDict(dict(
      num_stages=3, patch_size=patch_size, ar_depth=depth, ar_width=width, ar_heads=heads, den_depth=den_depth,
      den_width=width, den_heads=heads, mlp_ratio=4.0, cond_drop_rate=0.1, scan_blocks=False))
  c.flow = ml_collections.ConfigDict(dict(gamma=1 / 3, num_train_timesteps=1000, time_windows='uniform'))
  c.gradnorm = ml_collections.ConfigDict(dict(lr=1e-3, alpha=1.5, layer='ar/norm', min_weight=1e-3))
  c.dtype = 'float32'            # compute dtype (TF32 matmuls on NVIDIA GPUs); parameters stay float32
  c.attn_backend = 'cudnn'       # 'xla' runs everywhere; 'cudnn' needs an NVIDIA GPU
  c.sample = ml_collections.ConfigDict(dict(num_steps=250, cfg=1.5, seed=0, batch_size=16, scan_blocks=False))
  c.train = common.train_config(steps=steps, batch_size=256, lr=1e-4, b1=0.9, b2=0.999, weight_decay=0.0,
                                schedule='constant', grad_clip=0.0, ema_decay=0.9999)
  c.data = common.data_config(source='imagenet', crop='center', hflip=True)
  c.vae_ckpt = ''
  return c


def _without_ar(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The section 4.5 ablation: the AR's layers move into the denoisers."""
  m = c.model
  extra = round(m.ar_depth / m.num_stages)
  m.den_depth = tuple(d + extra for d in m.den_depth) if isinstance(m.den_depth, tuple) else m.den_depth + extra
  m.ar_depth = 0
  c.variant += '_no_ar'
  return c


def _tiny() -> ml_collections.ConfigDict:
  c = _paper('S')
  c.variant = 'tiny'
  c.image_size = 32
  c.num_classes = 10
  c.latent_space = 'pixel'
  c.model = ml_collections.ConfigDict(dict(
      num_stages=3, patch_size=4, ar_depth=3, ar_width=128, ar_heads=4, den_depth=2, den_width=128, den_heads=4,
      mlp_ratio=4.0, cond_drop_rate=0.1, scan_blocks=False))
  c.gradnorm.lr = 1e-2
  c.dtype = 'float32'
  c.attn_backend = 'xla'
  c.sample.update(num_steps=30, cfg=3.0, batch_size=10)
  # lr 2e-3 and EMA 0.99: 94 % of the final samples recognised as their class, against 85 % at lr 1e-3
  # and EMA 0.995, at the same cost (benchmarks/RESULTS.md, "The README's main job").
  c.train.update(steps=600, batch_size=32, lr=2e-3, warmup_steps=30, ema_decay=0.99, grad_clip=1.0,
                 log_every=20, ckpt_every=200, sample_every=200, sample_per_class=2, sample_classes=10)
  c.data.update(source='synthetic', num_examples=5000, crop='center', hflip=False, workers=0, threads=2)
  return c


def get_config(arg: str = 'S') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'unknown E-CAR variant {arg!r}; known: {VARIANTS}')
  size = arg.split('_')[0]
  if size == 'tiny':
    c = _tiny()
  else:
    c = _paper(size, patch_size=1 if arg.endswith('_patch1') else 4)
    c.variant = arg.removesuffix('_no_ar')
  return _without_ar(c) if arg.endswith('_no_ar') else c
