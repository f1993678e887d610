"""E-CAR's model configuration `ECARConfig` (configs/ecar.py maps onto it through `ecar.from_config`).

Every size is static: the stage grids, the token counts per stage and the flow's
sigmas all derive from a config, so shapes are fixed at trace time.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax.numpy as jnp

from ecar.flow import StageFlow, stage_flow
from var_models.nn import attention as attn_lib
from var_models.tokenizers.autoencoder_kl import SDXL_F8C4, AutoencoderKLConfig

LATENT_SPACES = ('vae', 'pixel')
TIME_WINDOWS = ('uniform', 'flow_length')


class ECARConfigError(ValueError):
  """A bad ECARConfig field; `field` names it so `ecar_config` can name the config key."""

  def __init__(self, field: str, message: str):
    super().__init__(f'ECARConfig.{field}: {message}')
    self.field, self.message = field, message


@dataclasses.dataclass(frozen=True)
class ECARConfig:
  """Defaults are E-CAR-S (configs/ecar.py:S) on 256 px images in the SDXL VAE's latent space.

  Stage s (0 = coarsest) works on a `stage_sizes[s]`-square grid; the last one
  is the data grid (latent 32 at 256 px, or the image itself in pixel space),
  each earlier one half of the next. Tokens are `patch_size`-square patches of
  the grid, for the AR transformer and the denoisers alike. `den_depth` is the
  denoisers' layer count, one for every stage or a tuple per stage. `ar_depth` 0
  is the paper's ablation without AR layers (its section 4.5): every stage's
  condition is then the class embedding at that stage's positions. `scan_blocks`: the
  teacher-forced forward (training) runs the AR's blocks and each denoiser's as one `lax.scan`
  over their stacked parameters, so that the train step compiles one block per stack (the
  sampler takes its own `scan_blocks`); the parameters on disk are the same.
  """
  image_size: int = 256
  num_classes: int = 1000
  latent_space: str = 'vae'
  vae: AutoencoderKLConfig = SDXL_F8C4
  num_stages: int = 3
  patch_size: int = 4
  ar_depth: int = 10
  ar_width: int = 768
  ar_heads: int = 6
  den_depth: Union[int, tuple[int, ...]] = (1, 3, 3)
  den_width: int = 768
  den_heads: int = 6
  mlp_ratio: float = 4.0
  cond_drop_rate: float = 0.1
  gamma: float = 1.0 / 3.0
  num_train_timesteps: int = 1000
  time_windows: str = 'uniform'
  gradnorm_lr: float = 1e-3
  gradnorm_alpha: float = 1.5
  gradnorm_layer: str = 'ar/norm'
  gradnorm_min_weight: float = 1e-3
  attn_backend: str = 'xla'
  dtype: Any = jnp.float32
  scan_blocks: bool = False

  def __post_init__(self):
    self._check_sizes()
    self._check_model()
    self._check_flow()

  def _check_sizes(self) -> None:
    _positive(self, 'image_size', 'num_classes', 'num_stages', 'patch_size')
    if self.latent_space not in LATENT_SPACES:
      raise ECARConfigError('latent_space', f'must be one of {LATENT_SPACES}, got {self.latent_space!r}')
    if self.latent_space == 'vae' and self.image_size % self.vae.downsample:
      raise ECARConfigError('image_size', f'{self.image_size} is not a multiple of the VAE downsampling '
                                          f'{self.vae.downsample}')
    coarsest = self.data_size // 2 ** (self.num_stages - 1)
    if coarsest * 2 ** (self.num_stages - 1) != self.data_size or coarsest % self.patch_size:
      raise ECARConfigError('num_stages', f'{self.num_stages} stages halve the {self.data_size}-grid down to '
                                          f'{self.data_size / 2 ** (self.num_stages - 1):g}, which must be a '
                                          f'multiple of patch_size {self.patch_size}')

  def _check_model(self) -> None:
    _positive(self, 'ar_width', 'ar_heads', 'den_width', 'den_heads', 'mlp_ratio')
    depths = self.den_depth if isinstance(self.den_depth, tuple) else (self.den_depth,) * self.num_stages
    if len(depths) != self.num_stages or not all(isinstance(d, int) and d > 0 for d in depths):
      raise ECARConfigError('den_depth', f'must be a positive int or {self.num_stages} of them (one per stage), '
                                         f'got {self.den_depth!r}')
    if self.ar_depth < 0:
      raise ECARConfigError('ar_depth', f'must be >= 0, got {self.ar_depth}')
    if self.ar_width % self.ar_heads:
      raise ECARConfigError('ar_heads', f'{self.ar_heads} does not divide ar_width {self.ar_width}')
    if self.den_width % self.den_heads:
      raise ECARConfigError('den_heads', f'{self.den_heads} does not divide den_width {self.den_width}')
    if not 0 <= self.cond_drop_rate < 1:
      raise ECARConfigError('cond_drop_rate', f'must be in [0, 1), got {self.cond_drop_rate}')
    try:
      attn_lib.check_backend(self.attn_backend)
    except ValueError as e:
      raise ECARConfigError('attn_backend', str(e)) from None

  def _check_flow(self) -> None:
    # Below 1/3 the jump still gives the training start's marginal (tests/test_ecar_flow.py).
    if not 0 < self.gamma <= 1 / 3 + 1e-12:
      raise ECARConfigError('gamma', f'must be in (0, 1/3] (the block noise covariance (1 + gamma) I - '
                                     f'gamma 11^T is not positive semi-definite above), got {self.gamma}')
    if self.num_train_timesteps < 0:
      raise ECARConfigError('num_train_timesteps', f'must be >= 0 (0: exact stage boundaries), '
                                                   f'got {self.num_train_timesteps}')
    if 0 < self.num_train_timesteps < self.num_stages:
      raise ECARConfigError('num_train_timesteps', f'{self.num_train_timesteps} cannot hold '
                                                   f'{self.num_stages} stages')
    if self.time_windows not in TIME_WINDOWS:
      raise ECARConfigError('time_windows', f'must be one of {TIME_WINDOWS}, got {self.time_windows!r}')
    _positive(self, 'gradnorm_alpha', 'gradnorm_min_weight')
    if self.gradnorm_lr < 0:
      raise ECARConfigError('gradnorm_lr', f'must be >= 0 (0: fixed equal weights), got {self.gradnorm_lr}')
    if not self.gradnorm_min_weight < 1:
      raise ECARConfigError('gradnorm_min_weight', f'must be < 1, got {self.gradnorm_min_weight}')
    if not self.gradnorm_layer.startswith('ar/'):
      raise ECARConfigError('gradnorm_layer', f'must name a layer of the AR transformer (shared by every '
                                              f"stage), i.e. start with 'ar/', got {self.gradnorm_layer!r}")

  # ---- derived sizes ----

  @property
  def data_channels(self) -> int:
    return self.vae.embed_dim if self.latent_space == 'vae' else 3

  @property
  def data_size(self) -> int:
    """Side of the data grid x0: the latent (image_size / f) or the image itself."""
    return self.image_size // self.vae.downsample if self.latent_space == 'vae' else self.image_size

  @property
  def den_depths(self) -> tuple[int, ...]:
    """Denoiser layers of every stage."""
    return self.den_depth if isinstance(self.den_depth, tuple) else (self.den_depth,) * self.num_stages

  @property
  def stage_sizes(self) -> tuple[int, ...]:
    return tuple(self.data_size // 2 ** (self.num_stages - 1 - s) for s in range(self.num_stages))

  @property
  def stage_tokens(self) -> tuple[int, ...]:
    return tuple((g // self.patch_size) ** 2 for g in self.stage_sizes)

  @property
  def begin_ends(self) -> tuple[tuple[int, int], ...]:
    """(begin, end) offsets of each stage's tokens in the AR sequence."""
    out, begin = [], 0
    for n in self.stage_tokens:
      out.append((begin, begin + n))
      begin += n
    return tuple(out)

  @property
  def num_tokens(self) -> int:
    return sum(self.stage_tokens)

  @property
  def token_dim(self) -> int:
    """Values per token: a patch of the data grid."""
    return self.patch_size ** 2 * self.data_channels

  @property
  def data_shape(self) -> tuple[int, int, int]:
    return (self.data_size, self.data_size, self.data_channels)

  @property
  def flow(self) -> StageFlow:
    """The multistage flow's static constants (sigmas, jumps, time windows)."""
    return stage_flow(self.num_stages, self.gamma, self.num_train_timesteps, self.time_windows)


def _positive(cfg: ECARConfig, *fields: str) -> None:
  for f in fields:
    v = getattr(cfg, f)
    if not v > 0:
      raise ECARConfigError(f, f'must be positive, got {v!r}')
