"""Train checkpoints under WORKDIR/checkpoints: orbax CheckpointManager, one step per folder.

Each step holds three items: 'state' (the whole TrainState: params, EMA, optimizer,
model state, counters, RNG), 'meta' (JSON: family, step, batch size, the data
position and layout, the config) and 'data' (the grain iterator's state, one JSON
file per process, written by grain's own orbax handler). Saves are asynchronous; orbax writes a step to a temporary
folder and renames it when complete, so a run killed mid-save leaves the previous
step as the latest. Restoring checks the stored tree against the one this config
builds, and any failure is an error that names the folder: a run never silently
starts again from scratch over existing checkpoints.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import grain
import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
  pass


def _key_name(k) -> str:
  for attr in ('name', 'key', 'idx'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _shapes(tree) -> dict[str, tuple]:
  """{dotted path (orbax's naming): shape} of a pytree of arrays or ShapeDtypeStructs."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {'.'.join(_key_name(k) for k in path): tuple(x.shape) for path, x in flat}


def check_layout(expected, stored_metadata, where: str) -> None:
  """Raises CheckpointError naming the first missing, unexpected or mis-shaped array."""
  exp = _shapes(expected)
  have = {m.name: tuple(m.shape) for m in jax.tree_util.tree_leaves(stored_metadata)}
  problems = [f'missing {k} {exp[k]}' for k in sorted(exp.keys() - have.keys())]
  problems += [f'unexpected {k} {have[k]}' for k in sorted(have.keys() - exp.keys())]
  problems += [f'{k} has shape {have[k]}, expected {exp[k]}' for k in sorted(exp.keys() & have.keys())
               if exp[k] != have[k]]
  if problems:
    raise CheckpointError(f'{where} does not fit this config ({len(problems)} differences, first: '
                          f'{"; ".join(problems[:3])}): it is from another model or config; '
                          'use another --workdir')


class Checkpoints:

  def __init__(self, workdir: str, keep: int):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    handlers = {'state': ocp.StandardCheckpointHandler(), 'meta': ocp.JsonCheckpointHandler(),
                'data': grain.checkpoint.CheckpointHandler()}
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict, data: grain.DatasetIterator) -> None:
    """Starts an asynchronous save of step `step` (a no-op if it is already on disk); `data`'s
    state is taken now, so it must have yielded exactly the batches of steps < `step`."""
    if step in self.manager.all_steps():
      return
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                                                    data=grain.checkpoint.CheckpointSave(data)), force=True)

  def restore_data(self, step: int, data: grain.DatasetIterator) -> None:
    """Sets `data` (built like the saved iterator: same start and workers) to step `step`'s saved state."""
    where = os.path.join(self.directory, str(step), 'data')
    try:
      self.manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(data)))
    except Exception as e:
      raise CheckpointError(f'cannot restore the data iterator from {where}: {e}') from e

  def _stored_meta(self, step: int, where: str) -> dict:
    try:
      return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
    except Exception as e:  # orbax raises many types for unreadable files
      raise CheckpointError(f'cannot read {where}/meta: {e}. The checkpoint is corrupt or not a '
                            'training checkpoint; move it away to start afresh') from e

  def restore(self, abstract_state: Any, expect: dict) -> tuple[Any, dict]:
    """The latest step laid out like `abstract_state` (ShapeDtypeStructs with shardings), and its meta.

    expect: meta values that must match (e.g. family, batch_size), each named in the error.
    """
    step = self.latest_step()
    where = os.path.join(self.directory, str(step))
    meta = self._stored_meta(step, where)
    for key, want in expect.items():
      if meta.get(key) != want:
        raise CheckpointError(f'{where} was written with {key}={meta.get(key)!r}, this run has {want!r}: '
                              'resume with the same setting, or use another --workdir')
    try:
      stored = self.manager.item_metadata(step)['state']
    except Exception as e:
      raise CheckpointError(f'cannot read {where}/state metadata: {e}. The checkpoint is corrupt') from e
    check_layout(abstract_state, getattr(stored, 'tree', stored), where)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
    except Exception as e:
      raise CheckpointError(f'cannot restore {where}: {e}. The checkpoint is corrupt; move it away '
                            'to start afresh or from an earlier step') from e
    return restored['state'], meta

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def abstract_like(tree, shardings):
  """ShapeDtypeStructs of `tree` (arrays or ShapeDtypeStructs) carrying `shardings`."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
