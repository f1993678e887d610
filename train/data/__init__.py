"""Training data: the built-in shapes, an image folder, ImageNet through tfds, cached latents.

`sources.make_examples(config, task, workdir)` -> (example(index, rng) -> {'image'
uint8 [S, S, 3] (or 'moments'), 'label'}, number of examples); `loader.Loader`
turns that into deterministic per-host batches.
"""
