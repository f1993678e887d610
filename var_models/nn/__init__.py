"""Layers every model shares: the attention entry point and KV cache, AdaLN/FFN blocks and the
`BlockHooks` policies plug into, the sampling-policy protocol (`Policy`, `Binding`, `Halves`),
the ViT block, DiT's timestep embedding, PyTorch-exact resampling, token gather/scatter, the
checks every family runs on its config and labels, and random parameters compiled as one program
(`init.compiled_init`). Imports `pallas_kernels` only.
"""
from var_models.nn import attention
from var_models.nn.attention import KVCache, LayerKVCaches, ScaleCausal, TokenMask, register_backend
from var_models.nn.blocks import BlockHooks
from var_models.nn.checks import check_attn_backend, check_labels, compute_dtype
from var_models.nn.policy import Binding, Halves, Policy
from var_models.nn.resample import area_resize, bicubic_resize, nearest_resize, resize
