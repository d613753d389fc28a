"""``omni-triton bench``: each stage and pipeline, run directly through the
runner library and through Triton, side by side in one run.

For every workload and concurrency c:
- direct: the runner library in this process; c requests at a time as one
  batch (diffusion, whose runner takes batches), or c closed-loop clients
  on the engine's event loop (the AR stages: the engines batch whatever is
  in flight, the raw vLLM ``AsyncLLM`` on vLLM). This is the raw engine curve;
- eager (diffusion on CUDA): the same direct run with the UNet's CUDA graphs
  off, i.e. plain diffusers;
- batch (``ar_encoder``): c prompts in one engine call, the best batch the
  engine can get, for reference;
- triton: c client processes in a closed loop against a server this command
  starts, with the same models and configs.

It prints a table (throughput, p50/p99 latency, Triton/direct throughput
ratio), and writes JSON and a PNG plot. Presets:
- ``tiny``: the demo models on CPU, a few minutes;
- ``realistic``: random weights at real sizes on a GPU (an SD1.5-size UNet
  and VAE at 512x512, 20 steps; a Qwen2.5-0.5B-size AR model). The direct
  phase runs first and frees its models before the server starts, so the
  two never share the GPU.
"""

from triton_omni_tools.bench.harness import Direct, Point, bench_repository, measure_direct, measure_triton, run
from triton_omni_tools.bench.presets import PRESETS, WORKLOADS, Preset, models_for

__all__ = ["PRESETS", "WORKLOADS", "Direct", "Point", "Preset", "bench_repository", "measure_direct",
           "measure_triton", "models_for", "run"]
