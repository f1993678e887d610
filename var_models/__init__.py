"""Shared blocks, tokenizers and next-scale models (VAR), their samplers and converters.

Public API:
  attention.attention, KVCache, ScaleCausal, TokenMask, register_backend -- the attention entry point
  resize, area_resize, bicubic_resize, nearest_resize            -- PyTorch-exact resampling
  ScaleSchedule, VAR_256, VAR_512, INFINITY_1024, get_schedule   -- scale schedules
  VQVAE, VQVAEConfig                                             -- VAR's multi-scale residual VQVAE
  VAR, VARConfig, init_params, loss_fn                           -- the VAR transformer
  make_sampler, ScalePolicy, Step, BlockHooks                    -- the sampler and its policy hooks
  MARPolicy, IterPlan                                            -- MAR's sampling policy hooks
  save_params, load_params                                       -- checkpoints on disk
Converters from the official checkpoints live in `var_models.convert`.
"""
from var_models import attention
from var_models.attention import KVCache, ScaleCausal, TokenMask, register_backend
from var_models.blocks import BlockHooks
from var_models.checkpoint import load_params, save_params
from var_models.mar_policy import IterPlan, MARPolicy
from var_models.policy import ScalePolicy, Step
from var_models.resample import area_resize, bicubic_resize, nearest_resize, resize
from var_models.schedules import INFINITY_1024, VAR_256, VAR_512, ScaleSchedule, get_schedule
from var_models.var import VAR, VARConfig, init_params, loss_fn
from var_models.var_sampler import make_sampler
from var_models.vqvae import VQVAE, VQVAEConfig
