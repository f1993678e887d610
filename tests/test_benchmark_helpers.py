"""The benchmarks' helpers: command-line settings ('a=1,b=true', ';'-separated sets of XLA options) and
the device's idle gaps in a trace."""
import pathlib
import sys

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent / 'benchmarks'))
from timing import device_gaps, host_events_under, settings, xla_variants   # noqa: E402  pylint: disable=wrong-import-position


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


def test_host_events_under_gaps_count_each_overlapped_gap_and_skip_long_spans():
  gaps = [(10.0, 12.0), (30.0, 40.0), (42.0, 43.0)]
  host = [('t', 'readback', 9.0, 2.0), ('t', 'launch', 35.0, 8.0), ('t', 'busy', 12.0, 18.0),
          ('t', 'readback', 31.0, 1.0), ('t', 'call', 0.0, 44.0)]
  assert host_events_under(host, gaps, longest_us=22.0) == {'readback': 2, 'launch': 2}
  assert host_events_under(host, gaps, longest_us=50.0)['call'] == 3
