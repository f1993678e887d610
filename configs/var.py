"""VAR configs: `--config configs/var.py:VARIANT` with VARIANT in d16, d20, d24, d30, tiny,
small256, vqvae, vqvae_tiny, vqvae_small256.

d16..d30 are the official ImageNet 256 px models (vae_ch160v4096z32.pth + var_dN.pth);
`tiny` runs on a CPU in seconds (32 px images, 4 scales). `train` and `data` are
the paper's training settings (utils/arg_util.py and the README's commands):
AdamW (0.9, 0.95), weight decay 0.05 (not on biases, norms, embeddings of
positions and levels, shared AdaLN), lr = tblr x batch / 256, warm-up over ep/50 epochs from
0.5 % of the peak, linear decay to wpe x peak, clip 2.0, no EMA, no flip.
`vqvae_ckpt` names the frozen tokenizer (converted or trained); empty = random.

`vqvae` trains the tokenizer itself (family 'vqvae'; the architecture of
vae_ch160v4096z32) on the paper's eq. 5: pixel MSE + the quantiser's VQ loss
(beta 0.25) + perceptual_weight x LPIPS + disc_weight x the adversarial loss.
The paper gives no weights for the last two, so `loss` takes the VQGAN /
LlamaGen tokenizer recipe: LPIPS (vgg, v0.1) with weight 1.0 (`lpips_ckpt`, a
directory from `python -m var_models.convert lpips`; empty = a random VGG, with
a warning); VQGAN's PatchGAN discriminator (64 channels, 3 layers) on the hinge
loss, unweighted (VQGAN's disc_factor 1; LlamaGen's 0.5 would change little under
Adam); the generator's term -mean(D(reconstruction)) with weight 0.5 and without
VQGAN's adaptive weight (LlamaGen's default, disc_adaptive_weight=False); both
switch on at step `disc_start` = 20000. The discriminator trains in the same
optimizer step as the VQVAE, with the same settings. The paper trains on
OpenImages and gives no optimiser: ours are VQGAN's Adam (0.5, 0.9), lr 1e-4
after 5K warm-up steps, batch 256, EMA 0.999, random crops with flips. Its export
(WORKDIR/params) is the VQVAE alone, a `vqvae_ckpt` for the VAR configs of the
same vqvae section. `vqvae_tiny` is tiny's tokenizer, for a few CPU minutes: no
perceptual term (at 32 px VGG16 costs 3x the VQVAE's forward FLOPs and would
more than double the step; without converted weights it is a random network
anyway); a 32-channel discriminator from step 100 of 300 with weight 0.05 (at 0.5,
with no adaptive weight, lr 2e-3 and only 100 steps on MSE before it, the
adversarial gradient swamps the pixel loss: the reconstructions collapse to blobs).

`small256` and its tokenizer `vqvae_small256` are the trained model the accelerators
(`accel`) are judged on, since no official weights can be downloaded here: VAR at
256 px on the official 10 scales, on the built-in shapes (10 classes), sized for a few
GPU minutes each (on one H200, 600 tokenizer and 1000 VAR steps take 1.6 and 2.6 minutes
with compiles; the accelerators' figures on that model: benchmarks/RESULTS.md, "VAR
accelerators: fidelity on the small trained VAR"). The VAR is depth 8 (width 512, 8
heads, 4 x MLP, the official block), trained 1500 steps at batch 64 (AdamW as the
paper's, lr 5e-4 after 200 warm-up steps, linear decay to 10 %). The tokenizer has
the official architecture at width 32 (ch_mult 1,1,2,2,4; one res block per level),
a 1024-code, 16-channel codebook, trained 1000 steps at batch 32 with Adam (0.5,
0.9) at lr 1e-3 on pixel MSE + VQ loss alone: no LPIPS (no VGG weights here) and no
discriminator (disc_start past the last step), on centre crops (the shapes' own
positions and sizes vary; the random crop's resampling would cost more CPU than the step). Samples take the paper's FID settings. The
commands (bf16, cudnn: a GPU):
    python -m train --config configs/var.py:vqvae_small256 --workdir runs/vqvae_small256
    python -m train --config configs/var.py:small256 --workdir runs/small256 \
        --config.vqvae_ckpt=runs/vqvae_small256
"""
import ml_collections

from configs import common

VARIANTS = ('d16', 'd20', 'd24', 'd30', 'tiny', 'small256', 'vqvae', 'vqvae_tiny', 'vqvae_small256')


# Global batch, base lr per 256 images, epochs, final lr fraction (the official README);
# other depths (tiny) start from d16's.
_TRAINING = {16: (768, 1e-4, 200, 0.1), 20: (768, 1e-4, 250, 0.1), 24: (768, 8e-5, 350, 0.01),
             30: (1024, 8e-5, 350, 0.01)}
_NO_DECAY = ('pos_start', 'pos_1LC', 'lvl_embed', 'ada_gss')


def _official(depth: int) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.family = 'var'
  c.variant = f'd{depth}'
  c.image_size = 256
  c.patch_nums = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
  c.num_classes = 1000
  c.model = ml_collections.ConfigDict(dict(
      depth=depth, width=64 * depth, num_heads=depth, mlp_ratio=4.0, shared_aln=False,
      attn_l2_norm=True, norm_eps=1e-6, drop_rate=0.0, drop_path_rate=0.1 * depth / 24,
      cond_drop_rate=0.1))
  c.vqvae = ml_collections.ConfigDict(dict(
      vocab_size=4096, z_channels=32, ch=160, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2,
      beta=0.25, quant_resi=0.5, share_quant_resi=4))
  c.dtype = 'bfloat16'           # compute dtype; parameters stay float32
  c.attn_backend = 'cudnn'       # 'xla' runs everywhere; 'cudnn' needs an NVIDIA GPU
  # The paper's FID settings; scan_blocks: each scale's blocks as one lax.scan (compiles once per
  # scale, not once per block: VAR-d30 in 13.7 s against 68.0, and runs no slower, RESULTS.md).
  c.sample = ml_collections.ConfigDict(dict(cfg=1.5, top_k=900, top_p=0.96, seed=0, batch_size=16,
                                            scan_blocks=True))
  batch, tblr, epochs, wpe = _TRAINING.get(depth, _TRAINING[16])
  c.train = common.train_config(
      steps=common.steps_for_epochs(epochs, batch), batch_size=batch, lr=tblr * batch / 256,
      b1=0.9, b2=0.95, weight_decay=0.05, no_decay=_NO_DECAY,
      warmup_steps=common.steps_for_epochs(epochs / 50, batch), warmup_init=0.005, schedule='linear',
      end_lr_fraction=wpe, grad_clip=2.0, ema_decay=0.0)
  c.data = common.data_config(source='imagenet', crop='random', hflip=False)
  c.vqvae_ckpt = ''
  return c


def _tiny() -> ml_collections.ConfigDict:
  c = _official(2)
  c.variant = 'tiny'
  c.image_size = 32
  c.patch_nums = (1, 2, 4, 8)
  c.num_classes = 10
  c.model.update(width=64, num_heads=2, drop_path_rate=0.0)
  c.vqvae.update(vocab_size=64, z_channels=8, ch=32, ch_mult=(1, 2, 2), num_res_blocks=1)
  c.dtype = 'float32'
  c.attn_backend = 'xla'
  c.sample.update(cfg=1.5, top_k=0, top_p=1.0, batch_size=8)
  c.train.update(steps=200, batch_size=32, lr=1e-3, warmup_steps=20, log_every=10, ckpt_every=100,
                 sample_every=100, sample_per_class=2, sample_classes=10)
  c.data.update(source='synthetic', num_examples=2000, crop='center', workers=0, threads=2)
  return c


def _small256() -> ml_collections.ConfigDict:
  c = _official(8)
  c.variant = 'small256'
  c.num_classes = 10
  c.vqvae.update(vocab_size=1024, z_channels=16, ch=32, num_res_blocks=1)
  c.sample.update(cfg=1.5, top_k=900, top_p=0.96, batch_size=10)
  c.train.update(steps=1500, batch_size=64, lr=5e-4, warmup_steps=200, log_every=100, ckpt_every=1500,
                 sample_every=1500, sample_per_class=2, sample_classes=10)
  c.data.update(source='synthetic', num_examples=50_000, crop='center', workers=0, threads=16)
  return c


def _tokenizer(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The VQVAE of VAR config c, trained on c's images (no transformer, no sampler)."""
  t = ml_collections.ConfigDict({k: c[k] for k in ('image_size', 'patch_nums', 'num_classes', 'vqvae', 'dtype',
                                                   'data')})
  t.family = 'vqvae'
  t.variant = 'vqvae' if c.variant.startswith('d') else f'vqvae_{c.variant}'
  t.train = c.train
  t.data.update(crop='random', hflip=True)
  t.loss = ml_collections.ConfigDict(dict(
      perceptual_weight=1.0,      # LPIPS (vgg, v0.1); 0 = off (no VGG is built)
      disc_weight=0.5,            # weight of the generator's adversarial term
      disc_start=20_000,          # train steps before the adversarial terms switch on
      disc_channels=64, disc_layers=3))  # PatchGAN width and stride-2 layers
  t.lpips_ckpt = ''               # `python -m var_models.convert lpips` output; '' = random VGG
  return t


def _vqvae() -> ml_collections.ConfigDict:
  c = _tokenizer(_official(16))
  c.train = common.train_config(steps=500_000, batch_size=256, lr=1e-4, b1=0.5, b2=0.9, weight_decay=0.0,
                                warmup_steps=5_000, schedule='constant', grad_clip=0.0, ema_decay=0.999)
  return c


def _vqvae_tiny() -> ml_collections.ConfigDict:
  c = _tokenizer(_tiny())
  c.train.update(steps=300, lr=2e-3, b1=0.5, b2=0.9, weight_decay=0.0, ema_decay=0.9)
  c.loss.update(perceptual_weight=0.0, disc_weight=0.05, disc_start=100, disc_channels=32)
  return c


def _vqvae_small256() -> ml_collections.ConfigDict:
  c = _tokenizer(_small256())
  c.train = common.train_config(steps=1000, batch_size=32, lr=1e-3, b1=0.5, b2=0.9, weight_decay=0.0,
                                warmup_steps=100, schedule='constant', grad_clip=0.0, ema_decay=0.99,
                                log_every=100, ckpt_every=1000, sample_every=1000, sample_per_class=2,
                                sample_classes=10)
  c.data.update(crop='center', hflip=False)
  c.loss.update(perceptual_weight=0.0, disc_start=c.train.steps, disc_channels=16, disc_layers=2)
  return c


def get_config(arg: str = 'd16') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'unknown VAR variant {arg!r}; known: {VARIANTS}')
  builders = {'tiny': _tiny, 'small256': _small256, 'vqvae': _vqvae, 'vqvae_tiny': _vqvae_tiny,
              'vqvae_small256': _vqvae_small256}
  return builders[arg]() if arg in builders else _official(int(arg[1:]))
