"""MAR configs: `--config configs/mar.py:VARIANT` with VARIANT in base, large, huge, small, tiny.

base/large/huge are the released MAR-B/L/H with the KL-16 VAE (kl16.ckpt) at
256 px; `tiny` runs on a CPU in seconds (32 px, 16 tokens, random weights); `small` (64 px, 64
tokens, a 16-token buffer, 4 + 6 blocks and a 6-block head: deep enough for every LazyMAR cache)
trains on the built-in data in minutes and is what LazyMAR's fidelity is measured on. `train` and
`data` are the paper's training settings (main_mar.py): AdamW (0.9, 0.95), weight
decay 0.02 (not on biases and norms), lr = 1e-4 x batch / 256 with batch 2048,
100 warm-up epochs from 0, then constant, 400 epochs, clip 3.0, EMA 0.9999,
ADM center crop and random flip; `data.cache_latents` is their --use_cached.
`vae_ckpt` names the frozen KL-16 VAE (converted); empty = random.
"""
import ml_collections

from configs import common

VARIANTS = ('base', 'large', 'huge', 'small', 'tiny')
# width, depth, heads (encoder = decoder), DiffLoss depth and width, evaluation cfg.
_SIZES = {'base': (768, 12, 12, 6, 1024, 2.9), 'large': (1024, 16, 16, 8, 1280, 3.0),
          'huge': (1280, 20, 16, 12, 1536, 3.2)}


def _released(variant: str) -> ml_collections.ConfigDict:
  width, depth, heads, dl_depth, dl_width, cfg = _SIZES[variant]
  c = ml_collections.ConfigDict()
  c.family = 'mar'
  c.variant = variant
  c.num_classes = 1000
  c.model = ml_collections.ConfigDict(dict(
      img_size=256, vae_stride=16, patch_size=1, encoder_embed_dim=width, encoder_depth=depth,
      encoder_num_heads=heads, decoder_embed_dim=width, decoder_depth=depth, decoder_num_heads=heads,
      mlp_ratio=4.0, vae_embed_dim=16, mask_ratio_min=0.7, label_drop_prob=0.1,
      attn_dropout=0.1, proj_dropout=0.1, buffer_size=64, diffloss_d=dl_depth, diffloss_w=dl_width,
      num_sampling_steps='100', diffusion_batch_mul=4))
  c.vae = ml_collections.ConfigDict(dict(
      embed_dim=16, z_channels=16, ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2,
      encoder_attn=True, decoder_attn=False, mid_attn=True, scaling_factor=0.2325))
  c.dtype = 'bfloat16'
  c.attn_backend = 'cudnn'
  # The paper's evaluation settings (256 iterations for FID; 64 is the fast setting); scan_blocks:
  # the encoder's and decoder's runs of alike blocks as one lax.scan each (compiles once per run);
  # encoder_sizes: the encoder runs on the known positions, padded into at most this many lengths
  # (each compiled once; 0: on every position, one length, see var_models/mar/sampler.py); host_loop:
  # the iterations driven from the host, a program per distinct iteration body that scans consecutive
  # alike iterations, compiled side by side (var_models/mar/host_loop.py).
  c.sample = ml_collections.ConfigDict(dict(
      num_iter=64, cfg=cfg, cfg_schedule='linear', temperature=1.0, num_diffusion_steps=100,
      seed=0, batch_size=16, scan_blocks=False, encoder_sizes=4, host_loop=False))
  c.train = common.train_config(
      steps=common.steps_for_epochs(400, 2048), batch_size=2048, lr=1e-4 * 2048 / 256, b1=0.9, b2=0.95,
      weight_decay=0.02, warmup_steps=common.steps_for_epochs(100, 2048), schedule='constant',
      grad_clip=3.0, ema_decay=0.9999)
  c.data = common.data_config(source='imagenet', crop='center', hflip=True)
  c.vae_ckpt = ''
  return c


def _tiny() -> ml_collections.ConfigDict:
  c = _released('base')
  c.variant = 'tiny'
  c.model.update(img_size=32, vae_stride=8, encoder_embed_dim=32, encoder_depth=2, encoder_num_heads=2,
                 decoder_embed_dim=48, decoder_depth=1, decoder_num_heads=2, vae_embed_dim=4,
                 buffer_size=4, diffloss_d=2, diffloss_w=32, num_sampling_steps='10')
  c.num_classes = 10
  c.vae.update(embed_dim=4, z_channels=4, ch=32, ch_mult=(1, 2, 2, 2), num_res_blocks=1)
  c.dtype = 'float32'
  c.attn_backend = 'xla'
  c.sample.update(num_iter=8, cfg=3.0, num_diffusion_steps=10, batch_size=8)
  c.train.update(steps=200, batch_size=32, lr=1e-3, warmup_steps=20, ema_decay=0.99, log_every=10,
                 ckpt_every=100, sample_every=100, sample_per_class=2, sample_classes=10)
  c.data.update(source='synthetic', num_examples=2000, workers=0, threads=2)
  return c


def _small() -> ml_collections.ConfigDict:
  c = _tiny()
  c.variant = 'small'
  c.model.update(img_size=64, encoder_embed_dim=128, encoder_depth=4, encoder_num_heads=4,
                 decoder_embed_dim=128, decoder_depth=6, decoder_num_heads=4, buffer_size=16,
                 diffloss_d=6, diffloss_w=128, num_sampling_steps='100')
  c.sample.update(num_iter=64, num_diffusion_steps=100)
  c.train.update(steps=3000, batch_size=64, lr=5e-4, warmup_steps=100, ema_decay=0.999, log_every=50,
                 ckpt_every=500, sample_every=1000)
  return c


def get_config(arg: str = 'base') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'unknown MAR variant {arg!r}; known: {VARIANTS}')
  return {'tiny': _tiny, 'small': _small}.get(arg, lambda: _released(arg))()
