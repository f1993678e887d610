"""Image tokenizers and the losses that train them: VAR's multi-scale residual VQVAE, the LDM KL
autoencoders (MAR's KL-16, the SDXL VAE), their conv encoder/decoder, LPIPS and the PatchGAN
discriminator; and the FID Inception network that scores what they help generate (`inception`).
Imports `var_models.nn` only.
"""
from var_models.tokenizers.autoencoder_kl import KL16, SDXL_F8C4, AutoencoderKL, AutoencoderKLConfig
from var_models.tokenizers.inception import FIDInceptionV3
from var_models.tokenizers.lpips import LPIPS
from var_models.tokenizers.patch_discriminator import PatchDiscriminator
from var_models.tokenizers.vqvae import VQVAE, VQVAEConfig
