"""The models of the project below E-CAR, one subpackage per responsibility:

  nn/          shared layers: attention entry point + KV cache, blocks and BlockHooks, ViT block,
               resampling, token gather/scatter, shared checks          (imports pallas_kernels)
  tokenizers/  VQVAE, KL autoencoders, conv encoder/decoder, LPIPS, PatchGAN (imports nn)
  var/         VAR: model, scale schedules, sampler, ScalePolicy        (imports nn, tokenizers)
  mar/         MAR: model, DiffLoss head, diffusion, sampler, MARPolicy (imports nn, tokenizers)
  convert/     official PyTorch checkpoints -> our params               (imports the above)
  checkpoint.py, flop_count.py: params on disk and jaxpr FLOP counting, which import nothing here.

This face re-exports the names most users need; nothing inside the package imports it.
"""
from var_models.checkpoint import load_params, save_params
from var_models.mar import IterPlan, MARPolicy, make_mar_sampler
from var_models.nn import (BlockHooks, KVCache, ScaleCausal, TokenMask, area_resize, attention,
                           bicubic_resize, nearest_resize, register_backend, resize)
from var_models.tokenizers import VQVAE, VQVAEConfig
from var_models.var import (INFINITY_1024, VAR, VAR_256, VAR_512, ScalePolicy, ScaleSchedule,
                            Step, VARConfig, get_schedule, init_params, loss_fn, make_sampler)
