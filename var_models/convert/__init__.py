"""Official PyTorch checkpoints -> our params: one module per model family, and the CLI.
Imports the model subpackages of `var_models` (nn, tokenizers, var, mar) and `checkpoint`.

API (dicts of NumPy arrays keyed by the official names, no PyTorch needed):
  convert_vqvae(state_dict, VQVAEConfig) -> VQVAE params
  convert_var(state_dict, VARConfig) -> VAR params
  convert_autoencoder_kl(state_dict, AutoencoderKLConfig) -> KL VAE params (LDM names)
  convert_mar(state_dict, MARConfig) -> MAR params (its DiffLoss head included)
  convert_diffusers_vae(state_dict, AutoencoderKLConfig) -> KL VAE params (diffusers names, SDXL)
  convert_lpips(vgg16 state_dict, lin state_dict) -> LPIPS params (VQVAE training's perceptual loss)
  convert_inception(state_dict) -> FID Inception params (pytorch-fid's port of the 2015-12-05 graph)
CLI (reading .pth/.ckpt files needs the `convert` extra, i.e. PyTorch):
  python -m var_models.convert var --vae vae_ch160v4096z32.pth --var var_d16.pth --depth 16 --out DIR
  python -m var_models.convert mar --vae kl16.ckpt --mar checkpoint-last.pth --model base --out DIR
  python -m var_models.convert sdxl-vae --vae diffusion_pytorch_model.safetensors --out DIR
  python -m var_models.convert lpips --vgg vgg16-397923af.pth --lin vgg.pth --out DIR
  python -m var_models.convert inception --pth pt_inception-2015-12-05-6726825d.pth --out DIR
"""
from var_models.convert.autoencoder_kl import convert_autoencoder_kl
from var_models.convert.common import StateDictReader, strip_prefix
from var_models.convert.diffloss import convert_diffloss
from var_models.convert.diffusers_vae import convert_diffusers_vae
from var_models.convert.inception import convert_inception, load_inception
from var_models.convert.lpips import convert_lpips
from var_models.convert.mar import convert_mar
from var_models.convert.var import convert_var, infer_var_depth
from var_models.convert.vqvae import convert_vqvae
