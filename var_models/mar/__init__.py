"""MAR, masked autoregression: the MAE encoder/decoder, the DiffLoss head and its Gaussian diffusion,
the compiled sampler and the `MARPolicy` hooks LazyMAR implements. Imports `var_models.nn` and
`var_models.tokenizers`.
"""
from var_models.mar.diffloss import DiffLossConfig
from var_models.mar.model import MAR, MARConfig, init_params, loss_fn
from var_models.mar.policy import IterPlan, MARPolicy, Site
from var_models.mar.sampler import make_mar_sampler
from var_models.mar.schedule import MARSchedule, mask_schedule
