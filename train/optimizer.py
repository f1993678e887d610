"""The optimizer and learning-rate schedule of `config.train`."""
from __future__ import annotations

import jax
import optax

SCHEDULES = ('constant', 'cosine', 'linear')


def lr_schedule(t) -> optax.Schedule:
  """Linear warm-up from warmup_init * lr to lr over warmup_steps, then the decay to
  end_lr_fraction * lr at t.steps ('constant' stays at lr)."""
  if t.schedule not in SCHEDULES:
    raise ValueError(f'config.train.schedule must be one of {SCHEDULES}, got {t.schedule!r}')
  decay_steps = max(1, t.steps - t.warmup_steps)
  end = t.lr * t.end_lr_fraction
  after = {'constant': optax.constant_schedule(t.lr),
           'cosine': optax.cosine_decay_schedule(t.lr, decay_steps, alpha=t.end_lr_fraction),
           'linear': optax.linear_schedule(t.lr, end, decay_steps)}[t.schedule]
  if t.warmup_steps == 0:
    return after
  warmup = optax.linear_schedule(t.lr * t.warmup_init, t.lr, t.warmup_steps)
  return optax.join_schedules([warmup, after], [t.warmup_steps])


def decay_mask(params, no_decay=()) -> object:
  """True where weight decay applies: arrays of rank >= 2 whose path names none of no_decay."""
  def one(path, x):
    names = {str(getattr(k, 'key', getattr(k, 'name', k))) for k in path}
    return x.ndim >= 2 and not names & set(no_decay)
  return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(t, schedule: optax.Schedule) -> optax.GradientTransformation:
  """Global-norm clipping (if grad_clip > 0), then AdamW with the schedule."""
  if t.optimizer != 'adamw':
    raise ValueError(f"config.train.optimizer must be 'adamw', got {t.optimizer!r}")
  adamw = optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                      mask=lambda p: decay_mask(p, tuple(t.no_decay)))
  return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw
