"""The benchmarks' command-line settings ('a=1,b=true', ';'-separated sets of XLA options)."""
import pathlib
import sys

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent / 'benchmarks'))
from timing import settings, xla_variants   # noqa: E402  pylint: disable=wrong-import-position


def test_settings_read_json_values_and_keep_list_values_whole():
  assert settings('encoder_sizes=0,scan_blocks=true,attn=cudnn') == dict(encoder_sizes=0, scan_blocks=True,
                                                                         attn='cudnn')
  assert settings('xla_gpu_enable_command_buffer=FUSION,CUBLAS,WHILE,xla_gpu_graph_min_graph_size=1') == {
      'xla_gpu_enable_command_buffer': 'FUSION,CUBLAS,WHILE', 'xla_gpu_graph_min_graph_size': 1}
  assert settings('') == {}


def test_xla_variants_are_one_dict_per_set_the_first_empty_for_the_defaults():
  assert xla_variants(';xla_gpu_enable_triton_gemm=false;xla_gpu_enable_command_buffer=FUSION,CUDNN') == [
      {}, {'xla_gpu_enable_triton_gemm': False}, {'xla_gpu_enable_command_buffer': 'FUSION,CUDNN'}]
