"""tests/gpu runs vLLM in the pytest process: the environment it needs on a GPU host."""

import os

from triton_omni_tools.launcher import vllm_gpu_env

for key, value in vllm_gpu_env().items():
    os.environ.setdefault(key, value)
