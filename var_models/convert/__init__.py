"""Official PyTorch checkpoints -> our params.

API (dicts of NumPy arrays keyed by the official names, no PyTorch needed):
  convert_vqvae(state_dict, VQVAEConfig) -> VQVAE params
  convert_var(state_dict, VARConfig) -> VAR params
CLI (reading .pth files needs the `convert` extra, i.e. PyTorch):
  python -m var_models.convert var --vae vae_ch160v4096z32.pth --var var_d16.pth --depth 16 --out DIR
"""
from var_models.convert.common import StateDictReader, strip_prefix
from var_models.convert.var import convert_var, infer_var_depth
from var_models.convert.vqvae import convert_vqvae
