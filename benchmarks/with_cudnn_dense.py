"""Runs a benchmark script with a `cudnn_dense` attention backend registered beside the others:
cuDNN's call for every attention, where the `cudnn` backend runs `few_token_attention` for a
sampler's unmasked calls of one block. Compares the two in one process:

  python3 benchmarks/with_cudnn_dense.py benchmarks/mar_host_loop.py --attn cudnn_dense,cudnn ...
  python3 benchmarks/with_cudnn_dense.py benchmarks/var_sampling.py --backends cudnn_dense,cudnn ...
"""
import os
import runpy
import sys

from var_models.nn import attention

if __name__ == '__main__':
  attention.register_backend('cudnn_dense', attention._dense_backend('cudnn'))
  sys.argv = sys.argv[1:]
  sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
  runpy.run_path(sys.argv[0], run_name='__main__')
