"""The benchmarks' helpers: command-line settings ('a=1,b=true', ';'-separated sets of XLA options),
the device's idle gaps in a trace, what an optimised program's loop bodies run, the weights a
sampler reads (its memory floor), XLA's compile timers summarised, and the CUDA graphs XLA's log
says it re-recorded."""
import dataclasses
import pathlib
import sys

import jax

import ecar
from accel import LazyMAR
from var_models.mar.from_config import init_mar_params
from var_models.mar.sampler import make_mar_sampler
from var_models.nn import blocks
from test_ecar_model import CFG as ECAR_CFG
from test_mar_sampler import MAR_CFG, VAE_CFG

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent / 'benchmarks'))
import floors   # noqa: E402  pylint: disable=wrong-import-position
from timing import (  # noqa: E402  pylint: disable=wrong-import-position
    device_gaps, gaps_by_neighbours, host_events_under, overlapping_kernels, settings, xla_variants)
from hlo_loops import loops   # noqa: E402  pylint: disable=wrong-import-position
from compile_passes import programs, summarise   # noqa: E402  pylint: disable=wrong-import-position
from mar_host_loop import MARKER, graph_updates   # noqa: E402  pylint: disable=wrong-import-position

# A scanned block's body as XLA's GPU dump writes it (abridged): a layer's weights and a LayerNorm
# scale sliced out of their stacks as asynchronous copies, a Triton GEMM, a split-K cuBLAS GEMM and
# its reduction.
_HLO = """
%body.1 (arg.1: (s32[], bf16[64,1280], bf16[4,1280,1280])) -> (s32[], bf16[64,1280], bf16[4,1280,1280]) {
  %fusion-start.1 = ((bf16[4,1280,1280]{2,1,0}, s32[]), bf16[1,1280,1280]{2,1,0}, u32[]) async-start(%a, %i), calls=%c.1
  %fusion-start.2 = ((f32[4,1280]{1,0}, s32[]), f32[1,1280]{1,0}, u32[]) async-start(%b, %i), calls=%c.2
  %gemm_fusion_dot.1 = bf16[64,1280]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %custom-call.2 = (f32[4,64,1280]{2,1,0}, s8[33554432]{0}) custom-call(%y, %v), custom_call_target="__cublas$lt$matmul"
  %loop_reduce_fusion.3 = bf16[64,1280]{1,0} fusion(%custom-call.2), kind=kLoop, calls=%fused_reduce.3
  ROOT %tuple.4 = (s32[], bf16[64,1280]{1,0}, bf16[4,1280,1280]{2,1,0}) tuple(%n, %h, %a)
}

ENTRY %main.9 (p.0: bf16[64,1280]) -> bf16[64,1280] {
  %while.7 = (s32[], bf16[64,1280]{1,0}, bf16[4,1280,1280]{2,1,0}) while(%tuple.1), condition=%cond.1, body=%body.1
}
"""


def test_settings_read_json_values_and_keep_list_values_whole():
  assert settings('encoder_sizes=0,scan_blocks=true,attn=cudnn') == dict(encoder_sizes=0, scan_blocks=True,
                                                                         attn='cudnn')
  assert settings('xla_gpu_enable_command_buffer=FUSION,CUBLAS,WHILE,xla_gpu_graph_min_graph_size=1') == {
      'xla_gpu_enable_command_buffer': 'FUSION,CUBLAS,WHILE', 'xla_gpu_graph_min_graph_size': 1}
  assert settings('') == {}


def test_xla_variants_are_one_dict_per_set_the_first_empty_for_the_defaults():
  assert xla_variants(';xla_gpu_enable_triton_gemm=false;xla_gpu_enable_command_buffer=FUSION,CUDNN') == [
      {}, {'xla_gpu_enable_triton_gemm': False}, {'xla_gpu_enable_command_buffer': 'FUSION,CUDNN'}]


def test_device_gaps_are_the_times_no_stream_runs_a_kernel():
  events = [('Stream #1', 'a', 0.0, 10.0), ('Stream #1', 'b', 12.0, 8.0), ('Stream #2', 'c', 15.0, 15.0),
            ('Stream #2', 'd', 40.0, 2.0), ('Stream #1', 'e', 43.0, 1.0),
            ('XLA Ops', 'conditional', 0.0, 44.0)]   # a view of the same work, spanning the gaps
  assert device_gaps(events, min_gap_us=1.0) == (44.0, [(10.0, 12.0), (30.0, 40.0), (42.0, 43.0)])
  assert device_gaps(events, min_gap_us=5.0) == (44.0, [(30.0, 40.0)])
  assert device_gaps([('XLA Ops', 'x', 0.0, 1.0)]) == (0.0, [])


def test_gaps_by_neighbours_name_each_gap_by_the_kernel_that_ended_last_and_the_one_after():
  events = [('Stream #1', 'memset', 0.0, 1.0), ('Stream #1', 'sdpa', 5.0, 10.0), ('Stream #2', 'gemm', 6.0, 2.0),
            ('Stream #1', 'memset', 18.0, 1.0), ('Stream #1', 'sdpa', 23.0, 10.0), ('Stream #1', 'k__3', 60.0, 1.0),
            ('XLA Ops', 'fusion', 0.0, 61.0)]   # not a stream: no kernel of its own
  assert gaps_by_neighbours(events, 2.0, 20.0) == {('memset', 'sdpa'): (2, 8.0), ('sdpa', 'memset'): (1, 3.0)}
  assert gaps_by_neighbours(events, 20.0) == {('sdpa', 'k'): (1, 27.0)}
  assert gaps_by_neighbours([], 0.0) == {}


def test_overlapping_kernels_sum_the_time_two_run_at_once_and_name_each_pair():
  events = [('Stream #1', 'a', 0.0, 10.0), ('Stream #2', 'b', 4.0, 10.0), ('Stream #2', 'c__2', 6.0, 2.0),
            ('Stream #1', 'd', 20.0, 5.0), ('XLA Ops', 'conditional', 0.0, 25.0)]   # not a stream
  multi, pairs = overlapping_kernels(events)
  assert multi == 6.0   # 4..10: a with b (and c)
  assert pairs == {('a', 'b'): 6.0, ('a', 'c'): 2.0, ('b', 'c'): 2.0}
  assert overlapping_kernels([]) == (0.0, {})


def test_host_events_under_gaps_count_each_overlapped_gap_and_skip_long_spans():
  gaps = [(10.0, 12.0), (30.0, 40.0), (42.0, 43.0)]
  host = [('t', 'readback', 9.0, 2.0), ('t', 'launch', 35.0, 8.0), ('t', 'busy', 12.0, 18.0),
          ('t', 'readback', 31.0, 1.0), ('t', 'call', 0.0, 44.0)]
  assert host_events_under(host, gaps, longest_us=22.0) == {'readback': 2, 'launch': 2}
  assert host_events_under(host, gaps, longest_us=50.0)['call'] == 3


def test_hlo_loops_counts_a_scanned_bodys_copies_gemms_and_rows():
  [(name, row)] = loops(_HLO, big=100_000, width=1280)
  assert name == '%while.7'
  assert row['copies, weight-sized'] == 1 and row['copies, small'] == 1
  assert (row['Triton GEMMs'], row['cuBLAS'], row['reductions'], row['kernels']) == (1, 1, 1, 3)
  assert row['rows'] == 64


_FLOOR_CFG = dataclasses.replace(MAR_CFG, decoder_depth=2)
# A head cache over 5 steps, t = 4 .. 0: full (the first), recompute (t > 2.5: block 1's delta replayed),
# full (t % 2 == 0), cached (block 1 replayed, block 0's MLP output reused: its adaLN gates alone), full.
_FLOOR_POLICY = LazyMAR(ratios=(1.0,) * 4, similarity_block=0, head_interval=2, head_warm=0.5, head_skip=(1,))


def _floor_sampler(policy=None):
  """A MAR sampler of 4 iterations and 5 head steps on `_FLOOR_CFG`, and its shape-only parameters."""
  params = jax.eval_shape(lambda k: init_mar_params(_FLOOR_CFG, VAE_CFG, k), jax.random.key(0))
  return make_mar_sampler(_FLOOR_CFG, VAE_CFG, num_iter=4, num_diffusion_steps=5, policy=policy), params


def test_mar_floor_reads_the_whole_head_every_step_and_lazymar_what_its_steps_run():
  sample, params = _floor_sampler()
  head, nbytes = params['mar']['diffloss'], lambda tree: floors.weight_bytes(tree, 'bfloat16')
  base = floors.sampler_reads(sample, params, 'bfloat16')
  assert base['encoder + decoder'] == (nbytes(params['mar']) - nbytes(head), 4)
  assert base['diffusion head'] == (nbytes(head), 20)
  lazy = floors.sampler_reads(_floor_sampler(_FLOOR_POLICY)[0], params, 'bfloat16')
  block = [nbytes(head[f'res_blocks_{i}']) for i in range(2)]
  gate0 = nbytes(head['res_blocks_0']['adaLN_modulation_1']) // 3
  loop = 3 * nbytes(head) + (nbytes(head) - block[1]) + (nbytes(head) - block[0] - block[1] + gate0)
  assert lazy['diffusion head'] == (4 * loop // 20, 20)
  assert lazy['encoder + decoder'] == base['encoder + decoder'] and lazy['KL-16 decoder'] == base['KL-16 decoder']


def test_ecar_floor_reads_the_ar_once_a_stage_and_each_denoiser_once_a_step():
  params = jax.eval_shape(lambda k: ecar.init_params(ECAR_CFG, k), jax.random.key(0))
  reads = floors.sampler_reads(ecar.make_sampler(ECAR_CFG, num_steps=(2, 3, 4)), {'ecar': params, 'vae': None},
                               'float32')
  nbytes = lambda tree: floors.weight_bytes(tree, 'float32')
  assert reads == {'AR': (nbytes(params['ar']), 3), **{f'denoiser {s}': (nbytes(params[f'denoiser_{s}']), n)
                                                       for s, n in enumerate((2, 3, 4))}}


def test_mar_traffic_reads_the_heads_adaln_once_a_loop_where_it_comes_ahead():
  sample, params = _floor_sampler()
  head, nbytes = params['mar']['diffloss'], lambda tree: floors.weight_bytes(tree, 'bfloat16')
  adaln = nbytes([head['time_embed'], head['cond_embed'], head['final_layer']['adaLN_modulation_1']]
                 + [head[f'res_blocks_{i}']['adaLN_modulation_1'] for i in range(2)])
  small = floors.sampler_reads(sample, params, 'bfloat16', batch=1)
  assert small['diffusion head'] == (nbytes(head) - adaln, 20)
  assert small['diffusion head adaLN, ahead'] == (adaln, 4)
  assert small['encoder + decoder'] == floors.sampler_reads(sample, params, 'bfloat16')['encoder + decoder']
  lazy = floors.sampler_reads(_floor_sampler(_FLOOR_POLICY)[0], params, 'bfloat16', batch=1)
  # _FLOOR_POLICY's step kinds: full x 3, recompute, cached; each kind's adaLN outputs come ahead, once a loop
  own = [nbytes(head[f'res_blocks_{i}']['adaLN_modulation_1']) for i in range(2)]
  rest = [nbytes(head[f'res_blocks_{i}']) - own[i] for i in range(2)]
  full = nbytes(head) - adaln
  assert lazy['diffusion head'] == (4 * (3 * full + (full - rest[1]) + (full - rest[0] - rest[1])) // 20, 20)
  assert lazy['diffusion head adaLN, ahead'] == (adaln + (adaln - own[1]) + (adaln - own[1] - own[0] + own[0] // 3), 4)
  rows = 2 * sample.schedule.mask.max_pred   # a batch whose rows pass the limit computes adaLN every step
  big = floors.sampler_reads(sample, params, 'bfloat16', batch=blocks.ADALN_AHEAD_MAX_ROWS // rows + 1)
  assert big == floors.sampler_reads(sample, params, 'bfloat16')


def test_ecar_traffic_reads_the_condition_and_adaln_once_a_stage():
  params = jax.eval_shape(lambda k: ecar.init_params(ECAR_CFG, k), jax.random.key(0))
  reads = floors.sampler_reads(ecar.make_sampler(ECAR_CFG, num_steps=(2, 3, 4)), {'ecar': params, 'vae': None},
                               'float32', batch=1)
  nbytes = lambda tree: floors.weight_bytes(tree, 'float32')
  for s, n in enumerate((2, 3, 4)):
    den = params[f'denoiser_{s}']
    once = nbytes([den['cond_proj'], den['t_embed'], den['final']['adaLN_modulation']]
                  + [den[k]['adaLN_modulation'] for k in den if k.startswith('blocks_')])
    assert reads[f'denoiser {s}'] == (nbytes(den) - once, n)
    assert reads[f'denoiser {s} once a stage'] == (once, 1)
  assert reads['AR'] == (nbytes(params['ar']), 3)

# XLA's timer lines as jax 0.11.2 logs them (abridged prefixes): two programs of one name on thread 886, a third
# compiled beside the second on thread 901.
_TIMERS = [
    'I1129 14:54:19.0 886 hlo_pass_pipeline.cc:176] HLO pass: priority-fusion time: 1.5 s (1500000 us) '
    '(cumulative: 9 s, max: 2 s, #called: 40)\n',
    'I1129 14:54:19.0 886 hlo_pass_pipeline.cc:176] HLO pass: cse time: 2 ms (2000 us) (cumulative: 9 s, '
    'max: 2 s, #called: 41)\n',
    'I1129 14:54:19.0 886 gpu_compiler.cc:2345] GpuCompiler::RunHloPasses for jit__sample time: 30.7 s '
    '(30731364 us) (cumulative: 2.23 min, max: 1.72 min, #called: 5)\n',
    'I1129 14:54:27.4 886 gpu_compiler.cc:3017] GpuCompiler::RunBackend for jit__sample time: 8.41 s '
    '(8413591 us) (cumulative: 26.3 s, max: 17.4 s, #called: 5)\n',
    'I1129 14:55:17.7 886 hlo_pass_pipeline.cc:176] HLO pass: priority-fusion time: 500 ms (500000 us) '
    '(cumulative: 12 s, max: 2 s, #called: 42)\n',
    'I1129 14:55:17.7 901 hlo_pass_pipeline.cc:176] HLO pass: priority-fusion time: 250 ms (250000 us) '
    '(cumulative: 12 s, max: 2 s, #called: 43)\n',
    'I1129 14:55:17.7 886 gpu_compiler.cc:2345] GpuCompiler::RunHloPasses for jit__sample time: 1.72 min '
    '(102920905 us) (cumulative: 3 min, max: 1.72 min, #called: 6)\n',
    'I1129 14:55:33.3 886 gpu_compiler.cc:3017] GpuCompiler::RunBackend for jit__sample time: 15.6 s '
    '(15604812 us) (cumulative: 41.9 s, max: 17.4 s, #called: 6)\n',
    'I1129 14:55:33.4 901 gpu_compiler.cc:2345] GpuCompiler::RunHloPasses for jit_init time: 1 ms '
    '(1000 us) (cumulative: 3 min, max: 1.72 min, #called: 7)\n',
]


def test_compile_passes_sums_each_pass_and_gives_each_program_its_halves_and_its_threads_passes():
  passes, halves = summarise(_TIMERS)
  assert passes == {'priority-fusion': (2.25, 3), 'cse': (0.002, 1)}
  assert programs(halves) == [['jit__sample', 30731364e-6, 8413591e-6, {'priority-fusion': 1.5, 'cse': 0.002}],
                              ['jit__sample', 102920905e-6, 15604812e-6, {'priority-fusion': 0.5}],
                              ['jit_init', 1e-3, 0.0, {'priority-fusion': 0.25}]]


def test_top_ops_counts_a_pallas_kernels_call_sites_as_one_op():
  """`residual_norm__3` and `residual_norm__5` are one kernel; XLA's `loop_fusion_1` and
  `loop_fusion_2` are different fusions and stay apart."""
  from timing import top_ops
  line = 'Stream #14(Compute)'
  events = [(line, 'residual_norm__3', 0, 2000), (line, 'residual_norm__5', 5, 3000),
            (line, 'loop_fusion_1', 9, 1000), (line, 'loop_fusion_2', 12, 1500)]
  ops, busy = top_ops(events)
  assert ops[0] == (line, 'residual_norm', 5.0, 2)
  assert {name for _, name, _, _ in ops[1:]} == {'loop_fusion_1', 'loop_fusion_2'}
  assert busy == {line: 7.5}


def test_family_job_lowers_the_sampler_its_arguments_call():
  """first_image.py's and accelerators.py's family rows: the program `family_job` lowers, called with
  its arguments, samples what the sampler itself samples (here scanned, with a policy)."""
  import numpy as np
  from accelerators import family_config, family_job, family_layouts
  config = family_config('ecar', 'tiny', 'float32', 'xla')
  family, makes, params = family_layouts(config, 'on', {'num_steps': 6})
  assert set(params) == {'scan'}
  sample, lowered, arguments = family_job(family, makes, params, 'ecarcache:every_2@scan', 2)
  images, _ = lowered.compile()(*arguments(3))
  want, _ = sample(params['scan'], jax.random.key(3), np.arange(2, dtype=np.int32) % family.num_classes,
                   **family.opts)
  assert images.shape == (2, config.image_size, config.image_size, 3)
  np.testing.assert_array_equal(images, want)


def test_graph_updates_counts_the_re_recordings_after_the_marker_by_graph_size():
  line = ('I1202 01:45:45.578280     651 command_buffer_thunk.cc:352] [0] Updated command buffer in {} μs; '
          'num_commands={}')
  log = '\n'.join([line.format(900, 571), MARKER, line.format(1200, 571), line.format(30, 19),
                   line.format(1300, 571), 'I1202 unrelated line'])
  assert graph_updates(log) == {571: (2, 2500), 19: (1, 30)}
