"""accel: the training-free accelerators of next-scale samplers, as sampling policies.

    from accel import FastVAR, LazyVAR, SparVAR
    sample = make_sampler(var_cfg, vq_cfg, policy=FastVAR.preset('infinity_2b'))

Each method is a `var_models.var.ScalePolicy` whose static settings are a frozen dataclass,
checked when built and again against the sampler's schedule and depth when the sampler binds
it (before anything compiles); `preset(name)` builds the published settings. `compose(a, b)`
runs two methods in one sampler. `policy_from_spec('fastvar:infinity_2b')` is the command
lines' form. LazyMAR is a `var_models.mar.MARPolicy` and ECARConditionCache an
`ecar.policy.StagePolicy`, with the same conventions. `python -m accel.compare` measures
an accelerated sampler against the baseline. Imports `var_models`, `ecar` and `pallas_kernels`.
"""
from accel.compose import compose
from accel.ecar_caches import ECARConditionCache
from accel.fastvar import FastVAR, FastVARHooks, keep_count, pivotal_tokens, restore_tokens
from accel.lazymar import LazyMAR
from accel.lazyvar import LazyVAR
from accel.sparvar import SparVAR
from accel.specs import METHODS, policy_from_spec
