"""Sample quality as the papers report it: class-balanced samples on disk, then FID, sFID, IS, precision and
recall against ADM's reference batch, and/or the built-in classifier's scores.

  python -m train.evaluate --config configs/var.py:d16 --ckpt DIR --out eval/d16 --cfg 1.5,2.0 \
      --ref VIRTUAL_imagenet256_labeled.npz --inception ckpt/inception [--num_samples 50000] [--policy fastvar:var256]
  python -m train.evaluate --config configs/var.py:tiny --ckpt runs/tiny --out eval/tiny --per_class 20

Labels: --num_samples / classes of each class (50 per class for 50,000 on ImageNet), class by class
(0, 0, ..., 1, 1, ...); a --num_samples that is not a multiple of the classes is an error, since the papers
balance classes exactly. --num_samples defaults to --per_class x classes.

Samples: per --cfg value, under OUT/cfg_{value}[_{policy}]/, one ADM-format shard per sampler call,
samples_{host}_{index:05d}.npz (arr_0: uint8 [N, H, W, 3], arr_1: int32 labels), written to a temporary
file and renamed, so a killed run resumes: shards already there (whichever host wrote them) are skipped;
the run's settings (settings.json beside them) must be the same, else it is an error.
Call `index` samples with fold_in(key, index), so every shard is the same whether or not the run was
cut. Each process (train/multihost.py starts multi-host runs) samples its contiguous share of the calls.

Metrics, on process 0 once every shard exists:
  --ref and --inception: Inception features (`python -m var_models.convert inception`) of the samples;
    FID (pool), sFID (spatial), IS (softmax of the logits), precision / recall (k = 3) against the
    reference batch (train/metrics.py). The reference statistics are the .npz's mu, sigma, mu_s, sigma_s
    where it stores them, else computed from its arr_0 images; precision / recall always need arr_0's
    pool features. Both are cached in OUT/reference_{ref name}.npz (recomputed for another --inception).
    ADM's stored statistics come from TF's graph, whose features ours are close to, not equal to
    (var_models/tokenizers/inception.py): drop them from the .npz to compare like with like.
  --builtin (default: on for config.data.source='synthetic'): class accuracy and Frechet distance of the
    built-in data's classifier (train/builtin_classifier.py). Its workdir is --ckpt when that is a training
    workdir with one (`python -m train` made it), else --out (trained there once).
Each --cfg value loads the params and compiles its sampler anew (MAR's guidance is static).
Results: a table (printed) and OUT/results.json, {run: {metric: value}}, merged metric by metric with
earlier runs'; sec_per_image is the median sampler call after the first (which compiles) over its batch,
kept from an earlier run when every shard already existed.
"""
from __future__ import annotations

import json
import os
import re
import time

import jax
import numpy as np
from absl import app, flags
from tqdm import tqdm

from sampling import compilation_cache, sampling_from_config
from sampling import flags as sf
from train import multihost
from train.builtin_classifier import BuiltinMetrics
from train.data import synthetic
from train.files import atomic_savez, atomic_write
from train.metrics import Statistics, feature_statistics, frechet_distance, inception_score, precision_recall
from var_models.convert.inception import load_inception

_OUT = flags.DEFINE_string('out', None, 'output directory: sample shards, caches, results.json')
_NUM = flags.DEFINE_integer('num_samples', None, 'images per --cfg value (default: --per_class x classes)')
_PER_CLASS = flags.DEFINE_integer('per_class', 50, 'images per class, when --num_samples is not given')
_CFG = flags.DEFINE_list('cfg', None, "guidance scales, comma separated (default: the config's)")
_POLICY = flags.DEFINE_string('policy', 'baseline', "sampler policy, e.g. 'fastvar:var256', 'lazymar:official', "
                              "'lazymar:official[decoder_sizes=1]' (a preset's setting changed)")
_REF = flags.DEFINE_string('ref', None, "ADM reference batch .npz (arr_0 images; mu, sigma, mu_s, sigma_s)")
_INCEPTION = flags.DEFINE_string('inception', None, 'FID Inception checkpoint (python -m var_models.convert inception)')
_BUILTIN = flags.DEFINE_bool('builtin', None, "the built-in classifier's scores (default: on for synthetic data)")

_SHARD = re.compile(r'samples_(\d+)_(\d{5})\.npz')
REF_STATS = ('mu', 'sigma', 'mu_s', 'sigma_s')
COLUMNS = ('images', 'fid', 'sfid', 'is', 'precision', 'recall', 'class_accuracy', 'frechet_distance',
           'sec_per_image')


def balanced_labels(num_samples: int, num_classes: int) -> np.ndarray:
  """[num_samples] int32: num_samples / num_classes of each class, class by class."""
  if num_samples < 2:
    raise ValueError(f'--num_samples must be >= 2 (feature statistics need two), got {num_samples}')
  if num_samples % num_classes:
    raise ValueError(f'--num_samples={num_samples} must be a multiple of the {num_classes} classes '
                     '(every class gets the same count)')
  return np.repeat(np.arange(num_classes, dtype=np.int32), num_samples // num_classes)


def host_batches(num_batches: int, host: int, hosts: int) -> range:
  """The contiguous sampler calls process `host` of `hosts` makes."""
  return range(num_batches * host // hosts, num_batches * (host + 1) // hosts)


def done_shards(directory: str) -> dict[int, str]:
  """{call index: path} of the complete shards in `directory`, whichever host wrote them."""
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return {int(m[2]): os.path.join(directory, m[0]) for m in map(_SHARD.fullmatch, names) if m}


def sample_shards(family, policy, labels: np.ndarray, batch: int, key, directory: str):
  """Writes this host's missing shards of `labels`; returns seconds per image (see the docstring) or None."""
  host, done = jax.process_index(), done_shards(directory)
  calls = host_batches(-(-len(labels) // batch), host, jax.process_count())
  todo = [i for i in calls if i not in done]
  sample, times = family.make(policy), []
  for i in tqdm(todo, desc=os.path.basename(directory), unit='batch', disable=not todo):
    chunk = labels[i * batch:(i + 1) * batch]
    args = family.params, jax.random.fold_in(key, i), np.resize(chunk, batch)   # one shape for every call
    t0 = time.perf_counter()
    images = np.asarray(sample(*args, **family.opts)[0])[:len(chunk)]
    times.append((time.perf_counter() - t0) / batch)
    uint8 = np.clip(images * 255 + 0.5, 0, 255).astype(np.uint8)
    atomic_savez(os.path.join(directory, f'samples_{host}_{i:05d}.npz'), arr_0=uint8, arr_1=chunk)
  return float(np.median(times[1:] or times)) if times else None


def check_settings(directory: str, settings: dict) -> None:
  """Shards of a run resume only with the settings that drew them: kept in directory/settings.json."""
  path, settings = os.path.join(directory, 'settings.json'), json.loads(json.dumps(settings))  # as stored
  if os.path.exists(path):
    with open(path) as f:
      stored = json.load(f)
    if stored != settings:
      raise ValueError(f'{directory} holds samples drawn with {stored}, not {settings}: use another --out or '
                       'delete it')
  else:
    os.makedirs(directory, exist_ok=True)
    with open(path, 'w') as f:
      json.dump(settings, f, indent=1, sort_keys=True)


def read_shards(directory: str, num_batches: int):
  """Yields (uint8 images, labels) of every shard in call order; a missing shard is an error."""
  done = done_shards(directory)
  missing = sorted(set(range(num_batches)) - set(done))
  if missing:
    raise RuntimeError(f'{directory}: shards {missing[:8]} of {num_batches} are missing (a host did not finish?)')
  for i in range(num_batches):
    with np.load(done[i]) as f:
      yield f['arr_0'], f['arr_1']


def inception_featurizer(directory: str, batch: int):
  """The Inception checkpoint at `directory` as uint8 image batches -> {'pool', 'spatial', 'probs'} [N, ...],
  compiled once for calls of `batch` images (the last padded)."""
  model, params = load_inception(directory)

  @jax.jit
  def apply(x):
    out = model.apply({'params': params}, x.astype(np.float32) / 255)
    return {'pool': out['pool'], 'spatial': out['spatial'], 'probs': jax.nn.softmax(out['logits'])}

  def features(batches) -> dict[str, np.ndarray]:
    out = {'pool': [], 'spatial': [], 'probs': []}
    for images in batches:
      for j in range(0, len(images), batch):
        x = images[j:j + batch]
        for k, v in apply(np.resize(x, (batch,) + x.shape[1:])).items():
          out[k].append(np.asarray(v)[:len(x)])
    return {k: np.concatenate(v) for k, v in out.items()}
  return features


def check_ref(path: str) -> None:
  if not os.path.isfile(path):
    raise ValueError(f'--ref {path}: no such file')
  with np.load(path) as f:
    keys = set(f.files)
  if 'arr_0' not in keys:
    raise ValueError(f'--ref {path} holds {sorted(keys)} but no arr_0: precision and recall need the reference '
                     "images (ADM's reference batches hold them)")


def reference(path: str, inception: str, features, out: str) -> dict:
  """{'pool': ref pool features, 'fid': Statistics, 'sfid': Statistics}, cached in `out`."""
  stem = os.path.splitext(os.path.basename(path))[0]
  cache = os.path.join(out, f'reference_{stem}.npz')
  if os.path.exists(cache):
    with np.load(cache) as f:
      if str(f['inception']) == os.path.abspath(inception):
        return {'pool': f['pool'], 'fid': Statistics(f['mu'], f['sigma']), 'sfid': Statistics(f['mu_s'], f['sigma_s'])}
  with np.load(path) as f:
    stats = {k: f[k] for k in REF_STATS if k in f.files}
    feats = features([f['arr_0']])
  if len(stats) < len(REF_STATS):   # ADM's batches store them; other files get them from their images
    fid, sfid = feature_statistics(feats['pool']), feature_statistics(feats['spatial'])
    stats = dict(mu=fid.mu, sigma=fid.sigma, mu_s=sfid.mu, sigma_s=sfid.sigma)
  atomic_savez(cache, pool=feats['pool'], inception=os.path.abspath(inception), **stats)
  return reference(path, inception, features, out)


def inception_metrics(feats: dict, ref: dict) -> dict:
  precision, recall = precision_recall(ref['pool'], feats['pool'])
  return {'fid': frechet_distance(feature_statistics(feats['pool']), ref['fid']),
          'sfid': frechet_distance(feature_statistics(feats['spatial']), ref['sfid']),
          'is': inception_score(feats['probs']), 'precision': precision, 'recall': recall}


def builtin_workdir(ckpt, out: str) -> str:
  """A training workdir that has the built-in classifier (`python -m train` made it), else --out."""
  return ckpt if ckpt and os.path.isdir(os.path.join(ckpt, 'builtin_classifier')) else out


def merge_results(path: str, rows: dict) -> dict:
  """rows merged into the JSON at `path`, metric by metric (a run's metrics not computed now are kept, and
  so is its sec_per_image when every shard existed); returns all rows."""
  merged = {}
  if os.path.exists(path):
    with open(path) as f:
      merged = json.load(f)
  for run, row in rows.items():
    merged[run] = {**merged.get(run, {}), **{k: v for k, v in row.items() if v is not None}}
  atomic_write(path, lambda f: json.dump(merged, f, indent=1, sort_keys=True), 'w')
  return merged


def table(rows: dict) -> str:
  """Markdown, one row per run, '-' where a metric was not computed."""
  cell = lambda v: '-' if v is None else (f'{v:.4g}' if isinstance(v, float) else str(v))
  head = '| run | ' + ' | '.join(COLUMNS) + ' |\n' + '| --- ' * (len(COLUMNS) + 1) + '|'
  return '\n'.join([head] + [f'| {run} | ' + ' | '.join(cell(r.get(c)) for c in COLUMNS) + ' |'
                             for run, r in sorted(rows.items())])


def _cfg_values() -> list:
  if not _CFG.value:
    return [None]   # the config's
  try:
    values = [float(v) for v in _CFG.value]
  except ValueError:
    raise ValueError(f'--cfg must be numbers, comma separated, got {_CFG.value}') from None
  if not all(np.isfinite(values)):
    raise ValueError(f'--cfg must be finite, got {_CFG.value}')
  return values


def _check_flags() -> None:
  if not _OUT.value:
    raise ValueError('--out: name the output directory')
  if bool(_REF.value) != bool(_INCEPTION.value):
    given, missing = ('--ref', '--inception') if _REF.value else ('--inception', '--ref')
    raise ValueError(f'{given} needs {missing}: FID and the other Inception metrics take both')
  if _REF.value:
    check_ref(_REF.value)
  if _INCEPTION.value and not os.path.isdir(_INCEPTION.value):
    raise ValueError(f'--inception {_INCEPTION.value}: no such directory (python -m var_models.convert inception)')
  if _PER_CLASS.value < 1:
    raise ValueError(f'--per_class must be >= 1, got {_PER_CLASS.value}')


def _policy(family):
  """The sampler policy --policy names: None for the baseline (plain sampling needs no accelerator)."""
  if _POLICY.value == 'baseline':
    return None
  from accel.specs import policy_from_spec   # accelerated sampling only
  return policy_from_spec(_POLICY.value, family.name)


def _run_name(family, spec: str) -> str:
  return f"cfg_{family.opts['cfg']:g}" + ('' if spec == 'baseline' else '_' + spec.replace(':', '_').replace('+', '__'))


def evaluate_run(family, labels, batch, key, directory, inception, ref, builtin) -> dict:
  """Samples (this host's share), then, on process 0, the metrics of one run; {} on other processes."""
  row = {'images': len(labels), 'options': family.options, 'policy': _POLICY.value}
  check_settings(directory, dict(row, batch_size=batch, seed=sf.pick(sf.SEED, sf.CONFIG.value.sample.seed),
                                 ckpt=sf.CKPT.value and os.path.abspath(sf.CKPT.value)))
  row['sec_per_image'] = sample_shards(family, _policy(family), labels, batch, key, directory)
  multihost.barrier(f'sampled {directory}')   # hosts sample unequal shares
  if jax.process_index():
    return {}
  num_batches = -(-len(labels) // batch)
  if inception:
    row.update(inception_metrics(inception(images for images, _ in read_shards(directory, num_batches)), ref))
  if builtin:
    images, got = map(np.concatenate, zip(*read_shards(directory, num_batches)))
    row.update(builtin.evaluate(images.astype(np.float32) / 255, got))
  return row


def main(argv):
  del argv
  compilation_cache.enable(compilation_cache.COMPILATION_CACHE.value)
  multihost.initialize(multihost.HEARTBEAT_TIMEOUT.value)
  config = sf.CONFIG.value
  sf.check_family(config)
  _check_flags()
  batch, cfgs, out = sf.batch_size(config.sample.batch_size), _cfg_values(), _OUT.value
  key = jax.random.key(sf.pick(sf.SEED, config.sample.seed))
  pkey, key = jax.random.split(key)
  plain = sampling_from_config(config, sf.overrides(config.family, cfgs[0]))
  plain.make(_policy(plain))   # a policy that does not fit fails before any parameter is made
  labels = balanced_labels(_NUM.value or _PER_CLASS.value * plain.num_classes, plain.num_classes)
  family = plain.with_params(plain.load(sf.CKPT.value, pkey))
  os.makedirs(out, exist_ok=True)
  inception = ref = builtin = None
  if _INCEPTION.value and jax.process_index() == 0:
    inception = inception_featurizer(_INCEPTION.value, batch)
    ref = reference(_REF.value, _INCEPTION.value, inception, out)
  if sf.pick(_BUILTIN, config.data.source == 'synthetic') and jax.process_index() == 0:
    size = config.model.img_size if config.family == 'mar' else config.image_size
    builtin = BuiltinMetrics.load_or_train(builtin_workdir(sf.CKPT.value, out), size,
                                           min(family.num_classes, synthetic.MAX_CLASSES), config.train.seed)
  rows = {}
  for cfg in cfgs:
    if cfg != cfgs[0]:
      family = sampling_from_config(config, sf.overrides(config.family, cfg)).with_params(family.params)
    name = _run_name(family, _POLICY.value)
    rows[name] = evaluate_run(family, labels, batch, key, os.path.join(out, name), inception, ref, builtin)
  if jax.process_index() == 0:
    print(table(merge_results(os.path.join(out, 'results.json'), rows)))


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
