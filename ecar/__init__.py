"""E-CAR: next-stage continuous AR with per-stage flow denoisers on a multistage (pyramidal) flow.

Public API:
  ECARConfig, ecar_config                -- the model config (ecar.config), and building it from
                                           configs/ecar.py (ecar.from_config)
  ECAR, init_params, param_count         -- the AR transformer + per-stage denoisers (one params tree)
  init_gradnorm, GradNormState, loss_fn  -- per-stage flow-matching loss balanced by GradNorm
  encode_images, decode, init_vae_params -- the data space: scaled SDXL-VAE latents, or pixels
  make_sampler, StagePolicy, FlowStep    -- the compiled sampler, its policy and guide's site
  sampling_flops                         -- matmul FLOPs of sampling one image (counted on the jaxpr)
  stage_flow, renoise_jump, block_noise  -- the multistage flow's pieces
"""
from ecar.config import ECARConfig
from ecar.from_config import ecar_config, ecar_params
from ecar.flops import sampling_flops
from ecar.flow import block_noise, renoise_jump, stage_flow
from ecar.gradnorm import GradNormState
from ecar.latents import decode, encode_images, init_vae_params
from ecar.loss import init_gradnorm, loss_fn
from ecar.model import ECAR, init_params, param_count
from ecar.policy import FlowStep, StagePolicy
from ecar.sampler import make_sampler
