"""E-CAR configs: `--config configs/ecar.py:VARIANT` with VARIANT in S, B, L, S_no_ar, tiny, tiny_no_ar.

S/B/L are the paper's E-CAR-S/B/L (its Table 1: AR layers 10/20/24, width
768/1024/1152, heads 6/16/16) on ImageNet 256 px in the SDXL VAE's latent space
(f8, 4 channels, scaling 0.13025): 3 stages at latent 8, 16, 32, patch size 1.
The paper gives the denoisers only as "much fewer layers than the AR" and the
totals 155M / 511M / 854M; denoisers as wide as the AR with 2 / 4 / 6 layers per
stage give 145.2M / 495.8M / 834.0M (-6.3 %, -3.0 %, -2.3 %).
`*_no_ar` is the paper's ablation (its section 4.5): the AR layers are replaced
by denoiser layers (ar_depth 0; each stage's denoiser gets ar_depth / S more
layers, so the layer total stays), and each stage is conditioned on the class
alone. `tiny` trains on a CPU in minutes: pixel space, 32 px, stages 8/16/32,
patch 4 (4 + 16 + 64 tokens).

`train`: the paper's settings (section 4.1): AdamW, lr 1e-4, no weight decay,
batch 256, 400K iterations (E-CAR-L: 800K). The paper is silent on warm-up,
clipping and EMA: none, none and the usual 0.9999. `flow`: Pyramid Flow's
(gamma 1/3, stage boundaries on a 1000-step grid); `time_windows` 'uniform' is
E-CAR's equal partition of the time interval. `gradnorm`: Chen et al.'s
alpha 1.5, on the AR's final LayerNorm (the last layer all stages share); the
weights' own Adam learning rate (1e-3; 1e-2 for tiny's short runs) is ours.
`sample`: 250 Euler steps in all, a third per stage
(the paper's evaluation); the paper gives no CFG scale: 1.5 (DiT's FID setting).
`vae_ckpt` names the frozen SDXL VAE (`python -m var_models.convert sdxl-vae`);
empty = random.
"""
import ml_collections

from configs import common

VARIANTS = ('S', 'B', 'L', 'S_no_ar', 'tiny', 'tiny_no_ar')
# AR depth, width, heads (Table 1); denoiser layers per stage; training iterations.
_SIZES = {'S': (10, 768, 6, 2, 400_000), 'B': (20, 1024, 16, 4, 400_000), 'L': (24, 1152, 16, 6, 800_000)}


def _paper(variant: str) -> ml_collections.ConfigDict:
  depth, width, heads, den_depth, steps = _SIZES[variant]
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
      num_stages=3, patch_size=1, ar_depth=depth, ar_width=width, ar_heads=heads, den_depth=den_depth,
      den_width=width, den_heads=heads, mlp_ratio=4.0, cond_drop_rate=0.1))
  c.flow = ml_collections.ConfigDict(dict(gamma=1 / 3, num_train_timesteps=1000, time_windows='uniform'))
  c.gradnorm = ml_collections.ConfigDict(dict(lr=1e-3, alpha=1.5, layer='ar/norm', min_weight=1e-3))
  c.dtype = 'bfloat16'           # compute dtype; parameters stay float32
  c.attn_backend = 'cudnn'       # 'xla' runs everywhere; 'cudnn' needs an NVIDIA GPU
  c.sample = ml_collections.ConfigDict(dict(num_steps=250, cfg_scale=1.5, seed=0, batch_size=16))
  c.train = common.train_config(steps=steps, batch_size=256, lr=1e-4, b1=0.9, b2=0.999, weight_decay=0.0,
                                schedule='constant', grad_clip=0.0, ema_decay=0.9999)
  c.data = common.data_config(source='imagenet', crop='center', hflip=True)
  c.vae_ckpt = ''
  return c


def _without_ar(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The section 4.5 ablation: the AR's layers move into the denoisers."""
  m = c.model
  m.den_depth += round(m.ar_depth / m.num_stages)
  m.ar_depth = 0
  c.variant += '_no_ar'
  return c


def _tiny() -> ml_collections.ConfigDict:
  c = _paper('S')
  c.variant = 'tiny'
  c.image_size = 32
  c.num_classes = 10
  c.latent_space = 'pixel'
  c.model.update(patch_size=4, ar_depth=3, ar_width=128, ar_heads=4, den_depth=2, den_width=128, den_heads=4)
  c.gradnorm.lr = 1e-2
  c.dtype = 'float32'
  c.attn_backend = 'xla'
  c.sample.update(num_steps=30, cfg_scale=3.0, batch_size=10)
  c.train.update(steps=600, batch_size=32, lr=1e-3, warmup_steps=30, ema_decay=0.995, grad_clip=1.0,
                 log_every=20, ckpt_every=200, sample_every=200, sample_per_class=2, sample_classes=10)
  c.data.update(source='synthetic', num_examples=5000, crop='center', hflip=False, workers=2)
  return c


def get_config(arg: str = 'S') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'unknown E-CAR variant {arg!r}; known: {VARIANTS}')
  if arg.startswith('tiny'):
    c = _tiny()
  else:
    c = _paper(arg.removesuffix('_no_ar'))
  return _without_ar(c) if arg.endswith('_no_ar') else c
