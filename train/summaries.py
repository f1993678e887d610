"""TensorBoard summaries under WORKDIR/tensorboard (written by process 0 only).

tensorboardX writes the event files without TensorFlow; view them with
`tensorboard --logdir WORKDIR/tensorboard`.
"""
from __future__ import annotations

import os
import struct

import numpy as np


class Summaries:

  def __init__(self, workdir: str, enabled: bool = True):
    self.writer = None
    if enabled:
      from tensorboardX import SummaryWriter
      self.writer = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def scalars(self, step: int, values: dict) -> None:
    """Scalars, and vectors (e.g. per-stage weights) as one scalar per index: name/0, name/1, ..."""
    if self.writer is None:
      return
    for name, value in sorted(values.items()):
      value = np.asarray(value, np.float64)
      if value.ndim == 0:
        self.writer.add_scalar(name, float(value), step)
      else:
        for i, v in enumerate(value.reshape(-1)):
          self.writer.add_scalar(f'{name}/{i}', float(v), step)
    self.writer.flush()

  def image(self, step: int, name: str, image: np.ndarray) -> None:
    """uint8 [H, W, 3]."""
    if self.writer is not None:
      self.writer.add_image(name, image, step, dataformats='HWC')
      self.writer.flush()

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()


def read_scalars(logdir: str, wall_time: bool = False) -> dict[str, list[tuple]]:
  """{tag: [(step, value), ...]} from the event files in `logdir` (TFRecords of Event protos), oldest
  file first: a resumed run's values follow the first run's. wall_time: (step, value, seconds since
  the epoch when it was written)."""
  from tensorboardX.proto import event_pb2
  scalars: dict[str, list[tuple]] = {}
  for name in sorted(os.listdir(logdir)):
    with open(os.path.join(logdir, name), 'rb') as f:
      while header := f.read(12):   # length, its CRC
        event = event_pb2.Event.FromString(f.read(struct.unpack('<Q', header[:8])[0]))
        f.read(4)   # the data's CRC
        for v in event.summary.value:
          row = (event.step, v.simple_value) + ((event.wall_time,) if wall_time else ())
          scalars.setdefault(v.tag, []).append(row)
  return scalars
