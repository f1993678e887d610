"""var_models.mar.flops: MAR sampling's model FLOPs, exact per iteration, and E-CAR Table 2's MAR rows."""
import jax
import numpy as np
import jax.numpy as jnp
import pytest

from var_models.flop_count import flops
from var_models.mar import model as mar_lib
from var_models.mar.flops import sampling_flops
from var_models.mar.schedule import mask_schedule
from var_models.tokenizers.autoencoder_kl import KL16, AutoencoderKLConfig

TINY_VAE = AutoencoderKLConfig(embed_dim=4, z_channels=4, ch=32, ch_mult=(1, 1, 1, 1), num_res_blocks=1)


def test_transformer_count_is_the_sum_of_each_iterations_exact_shapes():
  cfg = mar_lib.tiny()
  params = jax.eval_shape(lambda k: mar_lib.init_params(cfg, k), jax.random.key(0))
  model, rows = mar_lib.MAR(cfg), 2

  def traced(known):
    def run(p, t, c, k):
      return model.apply({'params': p}, t, c, k, method=lambda m, t, c, k: m.decode(m.encode(t, None, c, k), None, k))
    return flops(run, params, jax.ShapeDtypeStruct((rows, cfg.seq_len, cfg.token_embed_dim), jnp.float32),
                 jax.ShapeDtypeStruct((rows, cfg.encoder_embed_dim), jnp.float32),
                 jax.ShapeDtypeStruct((rows, cfg.buffer_size + known), jnp.int32))

  sched = mask_schedule(cfg.seq_len, 8)
  counted = sampling_flops(cfg, TINY_VAE, num_iter=8, num_steps=5)
  assert counted['transformer'] == pytest.approx(sum(traced(cfg.seq_len - int(m)) for m in sched.masked), rel=1e-9)
  assert counted['per_image'] == pytest.approx(counted['transformer'] + counted['head'] + counted['decode'])
  # Half the head steps, half the head FLOPs (the head's count is linear in its steps).
  half = sampling_flops(cfg, TINY_VAE, num_iter=8, num_steps=10)['head']
  assert half == pytest.approx(2 * counted['head'], rel=1e-6)


# E-CAR's Table 2 lists MAR-B / L / H at 18T / 34T / 60T (64 iterations, 100 head steps, CFG).
# Our count, 2 FLOPs per multiply-add without the VAE decoder, lands within 10 % for L and H;
# MAR-B's row is 19 % above it (configs/ecar.py records the calibration).
@pytest.mark.parametrize('size,ours,paper', [('base', 14.653e12, 18e12), ('large', 33.070e12, 34e12),
                                             ('huge', 65.177e12, 60e12)])
def test_mar_sampling_flops_against_e_car_table_2(size, ours, paper):
  counted = sampling_flops(getattr(mar_lib, size)(), KL16)['per_image_without_decode']
  assert counted == pytest.approx(ours, rel=1e-3)
  if size != 'base':
    assert abs(counted / paper - 1) < 0.10


def test_no_weighting_of_mars_parts_puts_all_three_table_2_rows_within_10_percent():
  """Why MAR-B stays out of the 10 %: Table 2's MAR rows are not one count of MAR's computation.
  With any weights a in [0, 3] on our transformer count, b in [0, 6] on the head's and the VAE
  decoder counted 0, 1 or 2 times, some row misses by more than 10 % (the best, 10.7 %, drops the
  transformer altogether); a = b = 1 is the computation itself (B -19 %)."""
  transformer, head, decode = np.array([10.997, 25.682, 49.708]), np.array([3.656, 7.388, 15.469]), 0.254
  paper = np.array([18.0, 34.0, 60.0])
  a, b, d = np.meshgrid(np.linspace(0, 3, 301), np.linspace(0, 6, 601), np.array([0.0, 1.0, 2.0]), indexing='ij')
  counted = a[..., None] * transformer + b[..., None] * head + d[..., None] * decode
  worst = np.max(np.abs(counted / paper - 1), axis=-1)
  assert worst.min() > 0.10
