"""The train state: everything a resumed run needs besides the data position."""
from __future__ import annotations

import contextlib
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from train.mesh import state_shardings
from var_models.nn.init import threefry_kernels


@flax.struct.dataclass
class TrainState:
  step: jax.Array         # int32 []: steps taken, skipped ones included (= batches read)
  skipped: jax.Array      # int32 []: steps skipped for a non-finite loss or gradient
  bad_in_a_row: jax.Array  # int32 []: the current run of skipped steps
  params: Any             # float32, trained
  ema_params: Any         # float32, EMA of params (sampling, evaluation)
  opt_state: Any
  model_state: Any        # the family's extra state carried through steps (E-CAR's GradNorm)
  rng: jax.Array          # uint32 key data (orbax stores plain arrays)

  @property
  def updates(self) -> jax.Array:
    """Optimizer updates applied (the schedule's position)."""
    return self.step - self.skipped


def init_state(init_fn, tx: optax.GradientTransformation, key: jax.Array) -> TrainState:
  """init_fn(key) -> (params, model_state); the run's RNG is split from the same seed."""
  k_init, k_run = jax.random.split(key)
  params, model_state = init_fn(k_init)
  zero = jnp.zeros((), jnp.int32)
  return TrainState(step=zero, skipped=zero, bad_in_a_row=zero, params=params, ema_params=params,
                    opt_state=tx.init(params), model_state=model_state,
                    rng=jax.random.key_data(k_run))


def abstract_state(init_fn, tx: optax.GradientTransformation, mesh, seed: int):
  """(ShapeDtypeStructs of the initial state, their NamedShardings on `mesh`)."""
  abstract = jax.eval_shape(lambda k: init_state(init_fn, tx, k), jax.random.key(seed))
  return abstract, state_shardings(mesh, abstract)


def sharded_init(init_fn, tx: optax.GradientTransformation, mesh, seed: int):
  """(the initial state, created already split over `mesh`, and its shardings). A state whole on
  every device (no FSDP) is drawn with threefry kernels (`init.threefry_kernels`: the same bits, a
  GPU compiles it in seconds instead of minutes); a state split over FSDP keeps XLA's threefry
  rounds, which the partitioner splits too (it would draw a kernel's whole output on every device)."""
  _, shardings = abstract_state(init_fn, tx, mesh, seed)
  init = jax.jit(lambda k: init_state(init_fn, tx, k), out_shardings=shardings)
  with threefry_kernels() if mesh.shape['fsdp'] == 1 else contextlib.nullcontext():
    state = init(jax.random.key(seed))
  return state, shardings
