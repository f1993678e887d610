"""VAR configs: `--config configs/var.py:VARIANT` with VARIANT in d16, d20, d24, d30, tiny.

d16..d30 are the official ImageNet 256 px models (vae_ch160v4096z32.pth + var_dN.pth);
`tiny` runs on a CPU in seconds (32 px images, 4 scales).
"""
import ml_collections

VARIANTS = ('d16', 'd20', 'd24', 'd30', 'tiny')


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
  # The paper's FID settings.
  c.sample = ml_collections.ConfigDict(dict(cfg=1.5, top_k=900, top_p=0.96, seed=0, batch_size=16))
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
  return c


def get_config(arg: str = 'd16') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'unknown VAR variant {arg!r}; known: {VARIANTS}')
  return _tiny() if arg == 'tiny' else _official(int(arg[1:]))
