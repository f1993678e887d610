"""Official DiffLoss denoiser weights (torch names under `diffloss.net.`) -> `SimpleMLPAdaLN` params.

The DiffLoss module holds no buffers (its diffusion schedules are plain NumPy), so
the net's Linear and LayerNorm weights are the whole of it.
"""
from __future__ import annotations

from typing import Mapping, Union

import numpy as np

from var_models.convert.common import StateDictReader
from var_models.mar.diffloss import DiffLossConfig
from var_models.nn.timestep import FREQ_DIM


def convert_diffloss(source: Union[StateDictReader, Mapping[str, np.ndarray]], cfg: DiffLossConfig,
                     prefix: str = 'diffloss.net.') -> dict:
  """Params tree of `cfg.make_net()`. Given a reader (e.g. the MAR converter's), keys are
  consumed from it and the caller calls `finish()`; given a plain state dict, any key
  left over is an error here. Missing or mis-shaped keys raise ValueError naming the key."""
  r = source if isinstance(source, StateDictReader) else StateDictReader(source)
  w, c, p = cfg.width, cfg.target_channels, prefix
  params = {
      'input_proj': r.linear(p + 'input_proj', c, w),
      'cond_embed': r.linear(p + 'cond_embed', cfg.z_channels, w),
      'time_embed': {'mlp_0': r.linear(p + 'time_embed.mlp.0', FREQ_DIM, w),
                     'mlp_2': r.linear(p + 'time_embed.mlp.2', w, w)},
      'final_layer': {'adaLN_modulation_1': r.linear(p + 'final_layer.adaLN_modulation.1', w, 2 * w),
                      'linear': r.linear(p + 'final_layer.linear', w, 2 * c)},
  }
  for i in range(cfg.depth):
    b = f'{p}res_blocks.{i}.'
    params[f'res_blocks_{i}'] = {'in_ln': r.norm(b + 'in_ln', w),
                                 'mlp_0': r.linear(b + 'mlp.0', w, w),
                                 'mlp_2': r.linear(b + 'mlp.2', w, w),
                                 'adaLN_modulation_1': r.linear(b + 'adaLN_modulation.1', w, 3 * w)}
  if not isinstance(source, StateDictReader):
    r.finish()
  return params
