"""pallas_kernels: block-sparse cross-scale attention, gathered-key attention, attention over a
few tokens, attention column sums per query group, top-k selection, top-k token gather/scatter,
dense + GELU, a dense layer of weights stacked on a layer axis, a gated residual with the next
modulated LayerNorm.

Kernels in Pallas (Triton lowering on NVIDIA GPUs; the block-sparse attention, both
directions, also in Mosaic GPU on Hopper; dense + GELU in Mosaic GPU only), their
layouts and the plain-jnp references they fall back to elsewhere. Imports jax only.
NOTES.md beside this file records floors, predictions and measurements.
"""
from pallas_kernels.column_sums import group_column_sums
from pallas_kernels.dense_gelu import dense_gelu
from pallas_kernels.dense_gelu import pays as dense_gelu_pays
from pallas_kernels.dispatch import IMPLS, override, resolve
from pallas_kernels.few_token_attention import ONE_BLOCK as FEW_TOKENS
from pallas_kernels.few_token_attention import Tiling as FewTokenTiling
from pallas_kernels.few_token_attention import few_token_attention
from pallas_kernels.few_token_attention import unsupported as few_token_attention_unsupported
from pallas_kernels.gathered_attention import gathered_attention
from pallas_kernels.layer_dense import layer_dense
from pallas_kernels.layout import (BlockLayout, default_block, dense_layout, layout_density,
                                   layout_from_mask, layout_from_rows, level_causal_layout,
                                   scale_causal_layout, schedule_levels, whole_tile_layout)
from pallas_kernels.reference import masked_attention
from pallas_kernels.residual_norm import residual_norm
from pallas_kernels.sparse_attention import MAX_HEAD_DIM, block_sparse_attention
from pallas_kernels.top_k import top_k_indices
from pallas_kernels.token_gather import gather_rows, token_scatter, topk_gather

__all__ = [
    'group_column_sums', 'dense_gelu', 'dense_gelu_pays', 'IMPLS', 'override', 'resolve', 'FEW_TOKENS',
    'FewTokenTiling', 'few_token_attention', 'few_token_attention_unsupported', 'gathered_attention',
    'layer_dense', 'BlockLayout', 'default_block', 'dense_layout', 'layout_density',
    'layout_from_mask', 'layout_from_rows', 'level_causal_layout', 'scale_causal_layout',
    'schedule_levels', 'whole_tile_layout',
    'masked_attention', 'residual_norm', 'MAX_HEAD_DIM', 'block_sparse_attention', 'gather_rows',
    'token_scatter', 'topk_gather', 'top_k_indices',
]
