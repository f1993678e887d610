"""Sampling from a config: the one adapter from a configs/{var,mar,ecar}.py config to its family's
compiled sampler and call options (training's sample grids, `python -m train.sample`,
`python -m train.evaluate`, `python -m accel.compare` and the benchmarks all go through it), the
flags the sampling command lines share (`sampling.flags`), and the persistent compilation cache
every command keeps its compiled programs in (`sampling.compilation_cache`).

Every family's sampler has one call shape:

    images, aux = sample(params, key, labels, *, cfg, **family_options)

with `.lower(...)` and `.arguments(...)` taking the same arguments.
"""
from sampling.from_config import Family, Sampling, family_from_config, sampling_from_config

__all__ = ['Family', 'Sampling', 'family_from_config', 'sampling_from_config']
