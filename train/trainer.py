"""The training loop: build or resume the state, step, log, checkpoint, sample, export.

WORKDIR holds checkpoints/ (resumed from when present), tensorboard/, samples/
(PNG grids of EMA samples), config.json, and at the end params/ + meta.json: the
EMA parameters with the frozen tokenizer, the layout `python -m train.sample --ckpt`
reads. A generator of the built-in data also gets builtin_classifier/ (made at the
first grid): each grid's samples, and config.train.sample_metrics - 1 more batches like
them, are scored by class accuracy and Frechet distance (train/builtin_classifier.py).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import signal
import time
from typing import Optional

import jax
import numpy as np
from absl import logging
from tqdm import tqdm

from train import grid as grid_lib
from train import mesh as mesh_lib
from train import multihost
from train import throughput
from train.builtin_classifier import BuiltinMetrics
from train.checkpoints import Checkpoints, abstract_like
from train.data import synthetic
from train.data.loader import Loader
from train.data.sources import make_examples
from train.optimizer import lr_schedule, make_optimizer
from train.startup import Startup, unbounded
from train.state import TrainState, abstract_state, sharded_init
from train.step import compile_train_step
from train.summaries import Summaries
from train.tasks import Task, make_task
from train.validate import check_config
from var_models import checkpoint as params_ckpt


class TrainingDiverged(RuntimeError):
  pass


class Preemption:
  """SIGTERM (or, across hosts, JAX's preemption notice) asks the run to save and stop.

  A context manager: the SIGTERM handler is installed for the run only. On many hosts JAX's own
  handler (installed by jax.distributed.initialize) feeds its preemption service, which picks one
  step for every host; a Python handler installed after it would silence it, so none is.
  """

  def __init__(self):
    self._requested, self._previous = False, None

  def __enter__(self):
    if jax.process_count() == 1:
      self._previous = signal.signal(signal.SIGTERM, self._on_signal)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def _on_signal(self, signum, frame):
    del signum, frame
    self._requested = True

  def __call__(self, step: int) -> bool:
    """Whether to save and stop after step `step` (the same answer on every host)."""
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      return multihost_utils.reached_preemption_sync_point(step)
    return self._requested


@dataclasses.dataclass
class Result:
  state: TrainState
  last_metrics: dict
  preempted: bool
  sample_scores: dict   # the last grid's class accuracy and Frechet distance (built-in data), or {}


def check_batch(t, num_devices: int) -> None:
  if t.batch_size % (t.grad_accum * num_devices):
    raise ValueError(f'config.train.batch_size={t.batch_size} must be a multiple of grad_accum '
                     f'({t.grad_accum}) x devices ({num_devices})')


_DETERMINISTIC_OPS = re.compile(r'--xla_gpu_deterministic_ops(=true|=1)?(\s|$)')


def first_step_hint(config, xla_flags: str) -> Optional[str]:
  """The fix for a first step that fails because of the job's setup, where the setup is known to:
  XLA's deterministic GPU ops do not run cuDNN's masked attention backward (VAR's scale-causal
  training fails its first step with `IndexError: absl::container_internal::raw_hash_map<>::at`,
  jax 0.11.2 on H200s; MAR's unmasked attention runs)."""
  if config.get('attn_backend') == 'cudnn' and _DETERMINISTIC_OPS.search(xla_flags):
    return ("the first train step failed under XLA's deterministic GPU ops (XLA_FLAGS has "
            "--xla_gpu_deterministic_ops) with config.attn_backend='cudnn': XLA does not run cuDNN's masked "
            'attention backward in that mode; set --config.attn_backend=xla for deterministic runs')
  return None


def sample_labels(t, num_classes: int) -> np.ndarray:
  """Row r of the grid is class r: [classes * per_class] int32."""
  return np.repeat(np.arange(min(t.sample_classes, num_classes), dtype=np.int32), t.sample_per_class)


class Trainer:

  def __init__(self, config, workdir: str, preemption: Optional[Preemption] = None,
               startup: Optional[Startup] = None):
    self.startup = startup or unbounded()
    with self.startup.phase('config and workdir checks'):
      check_config(config)
      self.config, self.t, self.workdir = config, config.train, os.path.abspath(workdir)
      multihost.check_same_config(config)
      multihost.check_shared_workdir(self.workdir)
    with self.startup.phase('model and frozen tokenizer'):
      self.task: Task = make_task(config)
    self.mesh = mesh_lib.make_mesh(self.t.mesh_data, self.t.mesh_fsdp)
    check_batch(self.t, self.mesh.size)
    self.is_main = jax.process_index() == 0
    self.preemption = preemption or Preemption()
    self.schedule = lr_schedule(self.t)
    self.tx = make_optimizer(self.t, self.schedule)
    with self.startup.phase('data pipeline'):
      example, num_examples = make_examples(config, self.task, self.workdir)
      d = config.data
      self.loader = Loader(example, num_examples, global_batch=self.t.batch_size, seed=self.t.seed,
                           steps=self.t.steps, process_index=jax.process_index(),
                           process_count=jax.process_count(), workers=d.workers, threads=d.threads)
    self.ckpts = Checkpoints(self.workdir, self.t.keep_checkpoints)
    self.resumed: Optional[dict] = None   # the meta of the checkpoint this run resumed from
    try:
      with self.startup.phase('train state (init or restore)'):
        self.state = self._initial_state()
        self.frozen = mesh_lib.put(self.task.frozen, mesh_lib.state_shardings(self.mesh, self.task.frozen))
    except Exception:
      self.ckpts.close()
      raise
    self._print_state_memory()
    self.summaries = Summaries(self.workdir, enabled=self.is_main)
    # A generator of the built-in data: its grid rows start with a real example of their class, and
    # its samples are scored (a tokenizer's grid shows reconstructions, which its loss measures).
    self.builtin = config.data.source == 'synthetic' and self.task.reconstruct is None
    self.scoring = self.builtin and self.t.sample_metrics > 0
    self.sample_scores: dict = {}   # the last grid's scores, shown in the progress line

  # ---- state ----

  def _data_layout(self) -> dict:
    """What a saved data iterator state depends on besides the step."""
    return {'processes': jax.process_count(), 'workers': self.loader.workers}

  def _meta(self, step: int) -> dict:
    return {'family': self.config.family, 'step': step, 'batch_size': self.t.batch_size,
            'data_position': step * self.t.batch_size, 'seed': self.t.seed,
            'data': {'start': self.data_start, **self._data_layout()},
            'config': json.loads(self.config.to_json_best_effort())}

  def _initial_state(self) -> TrainState:
    if self.ckpts.latest_step() is None:
      state, self.shardings = sharded_init(self.task.init, self.tx, self.mesh, self.t.seed)
      return state
    abstract, self.shardings = abstract_state(self.task.init, self.tx, self.mesh, self.t.seed)
    state, meta = self.ckpts.restore(abstract_like(abstract, self.shardings),
                                     {'family': self.config.family, 'batch_size': self.t.batch_size,
                                      'seed': self.t.seed})
    logging.info('resumed from step %d (data position %d)', meta['step'], meta['data_position'])
    self.resumed = meta
    return state

  def _print_state_memory(self) -> None:
    """The train state's bytes on this process's first device: fsdp = n divides the large arrays by n."""
    device = jax.local_devices()[0]
    gib = {name: throughput.bytes_on_device(getattr(self.state, name), device) / 2 ** 30
           for name in ('params', 'ema_params', 'opt_state')}
    print(f'process {jax.process_index()}: train state per device: params {gib["params"]:.3f} GiB, '
          f'EMA {gib["ema_params"]:.3f} GiB, optimizer {gib["opt_state"]:.3f} GiB')

  def _data_iterator(self, step: int):
    """The data iterator at step `step`: the checkpoint's grain state when this run reads the data as
    the saved one did (same processes and workers), else a new iterator started at `step`: the
    stream depends on the step alone, so both give the same batches."""
    saved = (self.resumed or {}).get('data')
    if saved and all(saved[k] == v for k, v in self._data_layout().items()):
      self.data_start = saved['start']
      data = self.loader.iterator(self.data_start)
      self.ckpts.restore_data(step, data)
      return data
    if saved:
      logging.info('data read by %s now (saved: %s): the data iterator starts afresh at step %d',
                   self._data_layout(), saved, step)
    self.data_start = step
    return self.loader.iterator(step)

  def _next_batch(self, data, step: int) -> dict:
    """Step `step`'s batch as global arrays; its rows must be the step's stream positions."""
    local = dict(next(data))
    positions, want = local.pop('position'), self.loader.local_positions(step)
    if not np.array_equal(positions, want):
      raise RuntimeError(f'the data iterator is at stream positions {positions[0]}..{positions[-1]}, step {step} '
                         f'reads {want[0]}..{want[-1]}: its restored state does not fit the checkpoint '
                         f'in {self.ckpts.directory}')
    return mesh_lib.global_batch(self.mesh, local)

  # ---- outputs ----

  def save(self, step: int, data) -> None:
    self.ckpts.save(step, self.state, self._meta(step), data)

  def sample_grid(self, step: int) -> Optional[str]:
    """A PNG grid (and TensorBoard image) of EMA samples, one row per class; for a tokenizer,
    originals next to their reconstructions."""
    if self.task.reconstruct is not None:
      images, ncol = self._reconstructions(), 2 * max(1, self.t.sample_per_class)
    else:
      labels = sample_labels(self.t, self.task.num_classes)
      if labels.size == 0:
        return None
      batches = self._ema_samples(labels, self.t.sample_metrics if self.scoring else 1)
      images, ncol = batches[0], self.t.sample_per_class
      if self.builtin:
        images, ncol = self._with_real_examples(images, labels), ncol + 1
    if not self.is_main:
      return None
    path = grid_lib.save_grid(images, os.path.join(self.workdir, 'samples', f'step_{step:07d}.png'), ncol=ncol)
    self.summaries.image(step, 'samples/ema', grid_lib.make_grid(images, ncol=ncol))
    if self.scoring:
      self._score_samples(step, np.concatenate(batches), np.tile(labels, len(batches)))
    return path

  def _ema_samples(self, labels: np.ndarray, batches: int) -> list[np.ndarray]:
    """`batches` batches [B, H, W, 3] of EMA samples of `labels`, each from its own key (the first
    is the grid's): one batch shape, so the sampler compiles once."""
    key = jax.random.key(self.t.sample_seed)
    if jax.process_count() > 1:
      labels = jax.device_put(labels, mesh_lib.replicated(self.mesh))
    return [mesh_lib.to_host(self.task.sample(self.state.ema_params, self.frozen,
                                              jax.random.fold_in(key, i) if i else key, labels))
            for i in range(batches)]

  def _with_real_examples(self, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Samples [C * per_class, H, W, 3], one row per class, with a real image of the class (the built-in
    data's renderer, fixed seed) before each row: [C * (per_class + 1), H, W, 3]."""
    per = self.t.sample_per_class
    rng = np.random.default_rng(self.t.sample_seed)
    real = np.stack([synthetic.render(int(c), images.shape[1], rng) for c in labels[::per]]) / np.float32(255)
    rows = images.reshape((-1, per) + images.shape[1:])
    return np.concatenate([real[:, None], rows], 1).reshape((-1,) + images.shape[1:])

  @functools.cached_property
  def _builtin_metrics(self) -> BuiltinMetrics:
    """The built-in data's classifier and reference statistics (trained and computed once per workdir)."""
    classes = min(self.task.num_classes, synthetic.MAX_CLASSES)   # the classes the dataset draws
    return BuiltinMetrics.load_or_train(self.workdir, self.task.image_size, classes, self.t.seed)

  def _score_samples(self, step: int, images: np.ndarray, labels: np.ndarray) -> None:
    """Class accuracy and Frechet distance of EMA samples [N, H, W, 3] of `labels` [N]."""
    scores = self._builtin_metrics.evaluate(images, labels)
    self.summaries.scalars(step, {f'samples/{k}': v for k, v in scores.items()})
    logging.info('step %d: %d EMA samples: class accuracy %.3f, Frechet distance %.2f', step, len(images),
                 scores['class_accuracy'], scores['frechet_distance'])
    self.sample_scores = {'step': step, **scores}

  @functools.cached_property
  def _originals(self) -> np.ndarray:
    """The dataset's first examples (fixed augmentation) that every reconstruction grid shows."""
    n = max(1, self.t.sample_per_class * self.t.sample_classes)
    rng = np.random.default_rng(self.t.sample_seed)
    return np.stack([self.loader.example(i % self.loader.num_examples, rng)['image'] for i in range(n)])

  def _reconstructions(self):
    """[original, reconstruction] pairs of `_originals`."""
    originals = self._originals
    rec = self.task.reconstruct(self.state.ema_params, jax.device_put(originals, mesh_lib.replicated(self.mesh)))
    pairs = np.stack([originals.astype(np.float32) / 255.0, np.asarray(mesh_lib.to_host(rec))], axis=1)
    return pairs.reshape((-1,) + originals.shape[1:])

  def export(self) -> None:
    """EMA params + frozen tokenizer in the `python -m train.sample --ckpt WORKDIR` layout."""
    trained, frozen = self.task.names
    ema = self.state.ema_params
    params = {trained: ema if self.task.export is None else self.task.export(ema)}
    # Pixel-space models have no tokenizer; a tokenizer's task names no frozen part to export.
    if frozen is not None and self.frozen is not None:
      params[frozen] = self.frozen
    params_ckpt.save_params(self.workdir, params,
                            {'family': self.config.family, 'step': int(self.state.step), 'ema': True})

  # ---- loop ----

  def compile_step(self, batch: dict):
    """The train step compiled for this mesh, the state's shardings and the global arrays of `batch`
    -> (compiled, matmul FLOPs per device). Prints the temporaries it needs per device."""
    compiled, _, flops = compile_train_step(
        self.task, self.tx, self.schedule, self.t, self.mesh, self.shardings, self.state, self.frozen, batch,
        # One process has no peer to compare with: skip printing the program's text.
        check_lowered=(functools.partial(multihost.check_same_program, 'train step')
                       if jax.process_count() > 1 else None))
    memory = compiled.memory_analysis()
    if memory is not None:
      print(f'process {jax.process_index()}: train step per device: temporaries '
            f'{memory.temp_size_in_bytes / 2 ** 30:.3f} GiB')
    return compiled, flops

  def run(self) -> Result:
    """Steps to config.train.steps (or a preemption); always leaves the checkpoints consistent."""
    if self.is_main:
      with open(os.path.join(self.workdir, 'config.json'), 'w') as f:
        f.write(self.config.to_json_best_effort(indent=2))
    try:
      with self.preemption:
        return self._loop(int(mesh_lib.to_host(self.state.step)))
    finally:
      self.ckpts.wait()
      self.ckpts.close()
      self.summaries.close()

  def _loop(self, start: int) -> Result:
    t = self.t
    if start >= t.steps:
      return Result(self.state, {}, False, {})
    with self.startup.phase('data pipeline: first batch'):
      data = self._data_iterator(start)
      first = self._next_batch(data, start)
    with self.startup.phase('compile the train step'):
      step_fn, flops = self.compile_step(first)
    with self.startup.phase('every process compiled'):
      multihost.barrier('train step compiled')   # the first step's collectives start together
    meter = _Meter(t, flops,
                   throughput.peak_flops(jax.devices()[0], t.peak_flops))
    bar = tqdm(total=t.steps, initial=start, desc=f'train {self.config.family}', unit='step',
               disable=not self.is_main, dynamic_ncols=True)
    pending, last, preempted = None, {}, False
    try:
      for step in range(start, t.steps):
        if step == start:
          with self.startup.phase('first step'):
            try:
              self.state, metrics = jax.block_until_ready(step_fn(self.state, self.frozen, first))
            except Exception as e:
              hint = first_step_hint(self.config, os.environ.get('XLA_FLAGS', ''))
              if hint is None:
                raise
              raise RuntimeError(hint) from e
        else:
          self.state, metrics = step_fn(self.state, self.frozen, self._next_batch(data, step))
        if pending is not None:   # the previous step's metrics: fetching them does not stall this one
          last = self._after_step(*pending, meter, bar)
        pending, done = (step + 1, metrics), step + 1
        checkpoint = done % t.ckpt_every == 0 or done == t.steps
        sample = done % t.sample_every == 0 or done == t.steps
        if checkpoint or sample:
          last, pending = self._after_step(*pending, meter, bar), None
          if checkpoint:
            self.save(done, data)
          if sample:
            self.sample_grid(done)
          meter.restart()
        if self.preemption(done):
          if pending is not None:
            last, pending = self._after_step(*pending, meter, bar), None
          self.save(done, data)
          preempted = True
          logging.warning('preempted: saved step %d; run the same command to resume', done)
          break
      if pending is not None:
        last = self._after_step(*pending, meter, bar)
      if not preempted:
        self.export()
    finally:
      bar.close()
      data.close()
    return Result(self.state, last, preempted, self.sample_scores)

  def _after_step(self, step: int, metrics, meter: '_Meter', bar) -> dict:
    values = {k: mesh_lib.to_host(v) for k, v in metrics.items()}
    bar.update(1)
    if values['bad_in_a_row'] >= self.t.max_bad_steps:
      raise TrainingDiverged(
          f'{int(values["bad_in_a_row"])} steps in a row had a non-finite loss or gradient (up to step {step}; '
          f'config.train.max_bad_steps={self.t.max_bad_steps}); the last checkpoint in '
          f'{self.ckpts.directory} holds the parameters before them')
    meter.add(values)
    if step % self.t.log_every == 0 or step == self.t.steps:
      summary = meter.summary()
      self.summaries.scalars(step, summary)
      scores = self.sample_scores
      shown = {'acc': f'{scores["class_accuracy"]:.2f}', 'fd': f'{scores["frechet_distance"]:.1f}'} if scores else {}
      bar.set_postfix(loss=f'{summary["loss"]:.4f}', skipped=int(values['skipped']), **shown)
    return values


_COUNTERS = ('skipped', 'bad_in_a_row')


class _Meter:
  """Means of the step metrics and the speed since the last summary."""

  def __init__(self, t, flops_per_step, peak):
    self.batch, self.flops, self.peak = t.batch_size, flops_per_step, peak
    self.restart()

  def restart(self):
    self.sums, self.count, self.skipped, self.t0 = {}, 0, 0, time.perf_counter()

  def add(self, values: dict):
    for k, v in values.items():
      if k not in _COUNTERS:
        self.sums[k] = self.sums.get(k, 0.0) + np.asarray(v, np.float64)
    self.skipped = values['skipped']
    self.count += 1

  def summary(self) -> dict:
    out = {k: v / max(self.count, 1) for k, v in self.sums.items()}
    out['skipped_steps'] = self.skipped
    dt = time.perf_counter() - self.t0
    if self.count and dt > 0:
      steps_per_s = self.count / dt
      out['perf/images_per_s'] = steps_per_s * self.batch
      mfu = throughput.mfu(self.flops, steps_per_s, self.peak)
      if mfu is not None:
        out['perf/mfu'] = mfu
    memory = throughput.peak_memory_gib()
    if memory is not None:
      out['perf/peak_memory_gib'] = memory
    self.restart()
    return out
