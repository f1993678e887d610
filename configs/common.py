"""Sections every family's config shares: `config.train` and `config.data`.

A family module sets its paper's settings through the keyword arguments, e.g.

  c.train = common.train_config(batch_size=768, lr=3e-4, weight_decay=0.05, ...)
  c.data = common.data_config(source='imagenet', crop='center')

and every key can still be overridden on the command line
(`--config.train.lr=1e-3`). `lr` is the peak learning rate itself: the family
modules apply their papers' base-lr x batch / 256 rule when they build it.
`train.validate` checks every key before anything compiles.
"""
import ml_collections

IMAGENET_TRAIN_SIZE = 1_281_167


def steps_for_epochs(epochs: float, batch_size: int, dataset_size: int = IMAGENET_TRAIN_SIZE) -> int:
  return max(1, round(epochs * dataset_size / batch_size))


def train_config(**overrides) -> ml_collections.ConfigDict:
  """Optimisation, schedule, parallelism and bookkeeping; defaults are a small generic run."""
  c = ml_collections.ConfigDict(dict(
      seed=0,
      steps=1000,                 # optimizer steps in the whole run (the schedule's length)
      batch_size=256,             # global batch, summed over hosts and devices
      grad_accum=1,               # micro-batches per step; batch_size / grad_accum per forward
      # optax.adamw; weight decay skips 1-D parameters (biases, norms) and names in no_decay.
      optimizer='adamw', lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, no_decay=(),
      # Linear warm-up from warmup_init * lr to lr, then 'constant', 'cosine' or 'linear' decay
      # to end_lr_fraction * lr at `steps`.
      warmup_steps=0, warmup_init=0.0, schedule='constant', end_lr_fraction=0.0,
      grad_clip=0.0,              # global-norm clipping; 0 = off
      ema_decay=0.9999,           # EMA of the parameters (sampling, evaluation); 0 = the last params
      max_bad_steps=20,           # non-finite loss/grad steps in a row before the run stops
      # Device mesh: `data` x `fsdp` devices (-1: all the devices left); fsdp > 1 shards the
      # parameters and optimizer state over that axis.
      mesh_data=-1, mesh_fsdp=1,
      log_every=50, ckpt_every=1000, keep_checkpoints=3,
      sample_every=5000, sample_per_class=4, sample_classes=8, sample_seed=0,
      # On the built-in data, with each grid: class accuracy and Frechet distance of this many
      # grid-sized batches of EMA samples (the grid's first), by a classifier the run trains once
      # (train/builtin_classifier.py); 0 = off.
      sample_metrics=5,
      peak_flops=0.0,             # per-device peak FLOP/s for MFU; 0 = from the device kind
  ))
  c.update(overrides)
  return c


def data_config(**overrides) -> ml_collections.ConfigDict:
  """Where images come from and how they are cropped."""
  c = ml_collections.ConfigDict(dict(
      source='synthetic',         # 'synthetic' (built in, no download), 'folder', 'imagenet'
      path='',                    # folder: root with one sub-folder per class; imagenet: tfds data_dir
                                  # ('' = tfds' default, ~/tensorflow_datasets)
      manual_dir='',              # imagenet: the directory holding ILSVRC2012_img_train.tar
      split='train',
      num_examples=50_000,        # synthetic: dataset size (an epoch); generated on the fly
      crop='center',              # 'center' (ADM center crop) or 'random' (resize to 1.125x, random crop)
      hflip=True,                 # random horizontal flip
      cache_latents=False,        # MAR: encode the dataset once under workdir/latents and reuse
      # The grain pipeline (train/data/loader.py): `workers` processes per host decode and augment
      # (0: the training process does), each with `threads` threads, each preparing a whole batch.
      # A core decodes and crops ~110-230 ImageNet JPEGs/s; E-CAR-B takes ~345/s per H100 from
      # JPEGs (benchmarks/RESULTS.md): give the pipeline the host's cores. The built-in data's
      # variants set workers=0.
      workers=16,
      threads=2,
  ))
  c.update(overrides)
  return c
