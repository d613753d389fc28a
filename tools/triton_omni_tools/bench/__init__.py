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

Where both sides fit on the GPU at once (on CPU, always), the direct side
stays loaded beside the server and each point is measured as a few
direct/triton pairs back to back (``--pairs``, the order alternating); the
ratio is the median of the pairs'. The host's speed drifts over minutes, so
only figures taken side by side compare.

It prints a table (throughput, p50/p99 latency, Triton/direct throughput
ratio), and writes JSON and a PNG plot. Presets:
- ``tiny``: the demo models on CPU, a few minutes;
- ``realistic``: random weights at real sizes on a GPU (an SD1.5-size UNet
  and VAE at 512x512, 20 steps; a Qwen2.5-0.5B-size AR model). Every stage
  twice does not fit one GPU, so a run of every workload measures the
  direct side first and frees its models before the server starts; a run
  of the AR stages alone (``--workloads ar,ar_encoder``), or of
  ``diffusion`` alone, measures in pairs.
"""

from triton_omni_tools.bench.harness import Direct, Point, bench_repository, measure_direct, measure_triton, run
from triton_omni_tools.bench.presets import PRESETS, WORKLOADS, Preset, models_for

__all__ = ["PRESETS", "WORKLOADS", "Direct", "Point", "Preset", "bench_repository", "measure_direct",
           "measure_triton", "models_for", "run"]
