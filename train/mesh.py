"""The device mesh, and the shardings of the train state and of the batch.

Every run, from one CPU to many hosts, uses one 2-D mesh with axes ('data', 'fsdp'):
  - the batch is split over both axes (each device sees batch / devices rows);
  - parameters, EMA and optimizer state are split over 'fsdp' along their largest
    dimension that 'fsdp' divides (replicated when none does or the array is small),
    and replicated over 'data'. fsdp = 1 is plain data parallelism.

On many hosts (train/multihost.py starts them) the devices are ordered host by host, so
an fsdp group is the devices of one host whenever fsdp divides the devices per host: the
parameter all-gathers stay on the host's own links, the gradient reductions over 'data'
cross hosts.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ('data', 'fsdp')
BATCH = P(AXES)            # leading (batch) dimension over every device
REPLICATED = P()
MIN_SHARDED_SIZE = 2 ** 14  # smaller arrays stay replicated: splitting them saves nothing


def mesh_shape(data: int, fsdp: int, num_devices: int) -> tuple[int, int]:
  """(data, fsdp) with -1 resolved; errors name the config key."""
  if fsdp < 1 or num_devices % fsdp:
    raise ValueError(f'config.train.mesh_fsdp={fsdp} must be >= 1 and divide the {num_devices} devices')
  if data == -1:
    data = num_devices // fsdp
  if data < 1 or data * fsdp != num_devices:
    raise ValueError(f'config.train.mesh_data={data} x mesh_fsdp={fsdp} must equal the {num_devices} devices '
                     '(mesh_data=-1 takes all that are left)')
  return data, fsdp


def device_grid(devices, data: int, fsdp: int) -> np.ndarray:
  """The devices as a [data, fsdp] array, host by host (process index, then device id)."""
  shape = mesh_shape(data, fsdp, len(devices))
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  grid = np.empty(len(ordered), object)
  grid[:] = ordered
  return grid.reshape(shape)


def make_mesh(data: int = -1, fsdp: int = 1, devices=None) -> Mesh:
  return Mesh(device_grid(jax.devices() if devices is None else devices, data, fsdp), AXES)


def param_spec(shape: tuple[int, ...], fsdp: int) -> P:
  """Splits the largest dimension that fsdp divides (the last such on ties) over 'fsdp'."""
  if fsdp == 1 or int(np.prod(shape)) < MIN_SHARDED_SIZE:
    return REPLICATED
  dims = [d for d in range(len(shape)) if shape[d] % fsdp == 0]
  if not dims:
    return REPLICATED
  best = max(dims, key=lambda d: (shape[d], d))
  return P(*[('fsdp' if d == best else None) for d in range(len(shape))])


def state_shardings(mesh: Mesh, abstract_tree):
  """NamedShardings for a pytree of arrays / ShapeDtypeStructs (params, optimizer state, ...)."""
  fsdp = mesh.shape['fsdp']
  return jax.tree.map(lambda x: NamedSharding(mesh, param_spec(tuple(np.shape(x)), fsdp)), abstract_tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, BATCH)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, REPLICATED)


def global_batch(mesh: Mesh, local: dict) -> dict:
  """This host's rows {name: [b, ...]} -> global arrays [b * processes, ...] split over the mesh."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local.items()}


def to_host(x) -> np.ndarray:
  """The whole value of a global array as NumPy, on every host (a collective when it is split
  over hosts: every host must call it)."""
  if x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def put(tree, shardings):
  """Host values (the same on every host) -> global arrays laid out by `shardings` (a pytree)."""
  def one(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
  return jax.tree.map(one, tree, shardings)
