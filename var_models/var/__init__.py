"""VAR, next-scale prediction: the AdaLN transformer, its scale schedules, the compiled sampler and
the `ScalePolicy` hooks accelerators implement. Imports `var_models.nn` and `var_models.tokenizers`.
"""
from var_models.var.model import VAR, VARConfig, init_params, loss_fn
from var_models.var.policy import ScalePolicy, Site, Step, var_binding
from var_models.var.sampler import make_sampler
from var_models.var.schedules import INFINITY_1024, VAR_256, VAR_512, ScaleSchedule, get_schedule
