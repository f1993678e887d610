"""The grain input pipeline on ImageNet-size JPEGs: decode + augment per core, the pipeline's
images/s over worker processes, and (with --train) whether a train step ever waits for it.

  python benchmarks/data_pipeline.py --workers 0,1,2                       # CPU: decoding
  python benchmarks/data_pipeline.py --workers 0,2 --imagenet              # also through tfds (`data` extra)
  python benchmarks/data_pipeline.py --workers 0,8,15 --train ecar:B      # GPU host: feeding

The benchmark writes --images JPEGs into --dir (one folder per class, ImageNet's usual
sizes: short side 333-375 at long side 500, 10 % larger ones up to 1000 px, content with
natural-image-like spectra at quality 90, so files weigh about as much as ImageNet's ~110 KB).

1. Per core: one process decodes and augments every image as the training configs do
   (center crop: MAR / E-CAR; random crop: VAR), images/s.
2. The pipeline (`train.data.loader.Loader` on the folder, host batch --batch) with each
   --workers count: images/s over --batches batches in steady state; and on cached latents
   (E-CAR-B's shape, memory-mapped as `data.cache_latents` reads them) in the training process.
   With --imagenet, the same JPEGs also go through tfds: written as ILSVRC2012 tars, prepared as
   `imagenet2012` (ArrayRecord), read and decoded by tfds as config.data.source='imagenet' reads
   them: per core and through the pipeline.
3. --train FAMILY:VARIANT: `python -m train`'s Trainer on the folder at --train_batch images
   (its frozen tokenizer random), --train_steps steps: step time and the time each step
   waited for its batch (median and max after the first --warmup steps), from the JPEGs
   and, for a model in a VAE's latent space, from the cached latents (encoded once first).
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import tempfile
import time

import grain
import numpy as np
from PIL import Image

from sampling import compilation_cache
from train.data.folder import ImageFolder
from train.data.imagenet import ImageNet, write_manual_tars
from train.data.latents import CachedLatents
from train.data.loader import Loader
from train.data.sources import image_examples
from train.data.transforms import preprocess


def natural_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
  """uint8 [H, W, 3] with a 1/f amplitude spectrum (as photographs have) plus sensor-like noise."""
  fy, fx = np.meshgrid(np.fft.fftfreq(height), np.fft.rfftfreq(width), indexing='ij')
  amplitude = 1.0 / np.maximum(np.hypot(fy, fx), 1.0 / max(height, width))
  channels = []
  for _ in range(3):
    phase = rng.uniform(0, 2 * np.pi, amplitude.shape)
    channels.append(np.fft.irfft2(amplitude * np.exp(1j * phase), s=(height, width)))
  img = np.stack(channels, -1)
  img = (img - img.mean()) / (img.std() + 1e-8) * 50 + 120 + rng.normal(0, 6, img.shape)
  return np.clip(img, 0, 255).astype(np.uint8)


def write_jpegs(directory: str, count: int, classes: int = 10, seed: int = 0) -> float:
  """`count` JPEGs under directory/<class>/; -> their mean size in KB."""
  rng = np.random.default_rng(seed)
  sizes = []
  for i in range(count):
    long = 500 if rng.random() < 0.9 else int(rng.integers(600, 1001))
    short = int(rng.choice([333, 375, 366, 350])) * long // 500
    h, w = (short, long) if rng.random() < 0.75 else (long, short)
    folder = os.path.join(directory, f'class{i % classes:02d}')
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f'{i:05d}.JPEG')
    Image.fromarray(natural_image(rng, h, w)).save(path, quality=90)
    sizes.append(os.path.getsize(path))
  return float(np.mean(sizes)) / 1024


def prepare_imagenet(folder: ImageFolder, directory: str) -> ImageNet:
  """The folder's JPEGs as tfds' imagenet2012 (class k of the folder is class k of its label list),
  prepared under directory/tfds from tars in directory/manual."""
  import tensorflow_datasets as tfds
  wnids = tfds.builder('imagenet2012').info.features['label'].names
  train = {}
  for path, label in zip(folder.files, folder.labels):
    with open(path, 'rb') as f:
      train.setdefault(wnids[label], []).append((f'{wnids[label]}_{os.path.basename(path)}', f.read()))
  write_manual_tars(os.path.join(directory, 'manual'), train, [train[wnids[0]][0][1]])
  return ImageNet(os.path.join(directory, 'tfds'), os.path.join(directory, 'manual'), 'train')


def per_core(source, size: int, crop: str) -> float:
  """Images/s of reading, decoding and augmenting every image of `source` in this process alone."""
  rng = np.random.default_rng(0)
  t0 = time.perf_counter()
  for i in range(len(source)):
    img, _ = source.load(i)
    preprocess(img, size, crop, True, rng)
  return len(source) / (time.perf_counter() - t0)


def pipeline_rate(example, num_examples: int, batch: int, workers: int, threads: int, batches: int) -> float:
  """Images/s of the grain pipeline in steady state: the batches it makes before the first is asked
  for (threads in each process) are taken first, then `batches` more are timed."""
  ahead = max(1, workers) * threads + 1
  loader = Loader(example, num_examples, global_batch=batch, seed=0, steps=ahead + batches, workers=workers,
                  threads=threads)
  data = loader.iterator(0)
  try:
    for _ in range(ahead):
      next(data)
    t0 = time.perf_counter()
    for _ in range(batches):
      next(data)
    return batches * batch / (time.perf_counter() - t0)
  finally:
    data.close()


def cached_latents(directory: str, count: int, shape=(32, 32, 8)) -> CachedLatents:
  """Random posteriors in the cache's layout (one part), as E-CAR-B's SDXL latents of 256 px images are."""
  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(0)
  np.save(os.path.join(directory, 'moments-0.npy'), rng.standard_normal((count, 2, *shape)).astype(np.float32))
  np.save(os.path.join(directory, 'labels-0.npy'), np.arange(count, dtype=np.int32) % 10)
  return CachedLatents(directory, 1, True)


class TimedIterator(grain.DatasetIterator):
  """The trainer's data iterator, recording when each batch was asked for and how long it took to come."""

  def __init__(self, data: grain.DatasetIterator):
    super().__init__(data)
    self.asked, self.waited = [], []

  def __next__(self):
    t0 = time.perf_counter()
    out = next(self._parent)
    self.asked.append(t0)
    self.waited.append(time.perf_counter() - t0)
    return out

  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state):
    self._parent.set_state(state)


def load_config(spec: str):
  family, variant = spec.split(':')
  return importlib.import_module(f'configs.{family}').get_config(variant)


def train_feed(spec: str, directory: str, args, cached: bool, workers: int) -> dict:
  """Step period and data waits of the Trainer on the JPEG folder (or its cached latents)."""
  from train.trainer import Trainer
  config = load_config(spec)
  config.data.update(source='folder', path=directory, workers=workers, threads=args.threads, cache_latents=cached)
  config.train.update(batch_size=args.train_batch, steps=args.train_steps, log_every=args.train_steps,
                      ckpt_every=10 ** 9, sample_every=10 ** 9, sample_classes=0)
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer(config, workdir)
    make = trainer.loader.iterator
    timed = []
    trainer.loader.iterator = lambda start: timed.append(TimedIterator(make(start))) or timed[-1]
    trainer.run()
  periods = np.diff(timed[0].asked)[args.warmup:]
  waits = np.asarray(timed[0].waited[args.warmup + 1:])
  return {'step_ms': 1e3 * statistics.median(periods), 'images_per_s': args.train_batch / statistics.median(periods),
          'wait_median_ms': 1e3 * statistics.median(waits), 'wait_max_ms': 1e3 * waits.max(),
          'waits_over_1ms': int((waits > 1e-3).sum()), 'steps': len(waits)}


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--images', type=int, default=400)
  p.add_argument('--dir', default='', help='where the JPEGs go (default: a temporary folder)')
  p.add_argument('--size', type=int, default=256, help='training resolution')
  p.add_argument('--batch', type=int, default=64, help='host batch of the pipeline measurement')
  p.add_argument('--batches', type=int, default=60)
  p.add_argument('--workers', default='0,1,2', help='worker process counts to measure')
  p.add_argument('--threads', type=int, default=2, help='threads per process')
  p.add_argument('--imagenet', action='store_true', help='also through tfds imagenet2012 (needs the data extra)')
  p.add_argument('--train', default='', help='FAMILY:VARIANT whose train step the pipeline feeds')
  p.add_argument('--train_batch', type=int, default=32)
  p.add_argument('--train_steps', type=int, default=60)
  p.add_argument('--warmup', type=int, default=10)
  args = compilation_cache.parse_args(p)
  with tempfile.TemporaryDirectory() as tmp:
    directory = args.dir or tmp
    kb = write_jpegs(directory, args.images)
    sources = {'JPEG files': ImageFolder(directory)}
    if args.imagenet:
      sources['tfds imagenet2012'] = prepare_imagenet(sources['JPEG files'], os.path.join(tmp, 'imagenet'))
    print(f"{len(sources['JPEG files'])} JPEGs, mean {kb:.0f} KB; {os.cpu_count()} cores")
    print('| per core | source | images/s |\n| --- | --- | ---: |')
    for name, source in sources.items():
      for crop in ('center', 'random'):
        print(f'| decode + {crop} crop {args.size} px + flip | {name} | {per_core(source, args.size, crop):.0f} |')
    print('\n| pipeline workers | source | threads | host batch | images/s |\n| ---: | --- | ---: | ---: | ---: |')
    counts = [int(w) for w in args.workers.split(',')]
    for name, source in sources.items():
      example = image_examples(source, args.size, 'center', True)
      for workers in counts:
        rate = pipeline_rate(example, len(source), args.batch, workers, args.threads, args.batches)
        print(f'| {workers} | {name} | {args.threads} | {args.batch} | {rate:.0f} |', flush=True)
    latents = cached_latents(os.path.join(tmp, 'latents'), 4096)
    rate = pipeline_rate(latents, 4096, args.batch, 0, args.threads, args.batches)
    print(f'| 0 | cached latents [32, 32, 8] | {args.threads} | {args.batch} | {rate:.0f} |', flush=True)
    if args.train:
      print(f'\n| {args.train} input | workers | step ms | images/s | wait median ms | wait max ms | '
            'steps waiting > 1 ms |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |')
      config = load_config(args.train)
      latent = config.family == 'mar' or config.get('latent_space') == 'vae'   # what cache_latents caches
      for cached in (False, True) if latent else (False,):
        r = train_feed(args.train, directory, args, cached, max(counts))
        name = 'cached latents' if cached else 'JPEGs'
        print(f"| {name} | {max(counts)} | {r['step_ms']:.1f} | {r['images_per_s']:.0f} | {r['wait_median_ms']:.2f} | "
              f"{r['wait_max_ms']:.1f} | {r['waits_over_1ms']} of {r['steps']} |", flush=True)


if __name__ == '__main__':
  main()
