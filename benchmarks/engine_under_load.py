"""Does other work on the host slow a vLLM engine's steps? The bench's
direct side of `ar` alone, then with N busy processes beside it, in turns.

Through Triton, vLLM's decode steps took 10 to 16 % longer than direct from
8 streams up on an H200, with the same batch and CUDA graph, while the stub,
tritonserver and the client processes kept two to three more cores busy
(docs/benchmarks.md, "Thirteenth pass"). This asks whether that much other
work slows the engine by itself, with nothing of Triton running: each round
measures the same closed loop (the bench's direct clients on the raw
``AsyncLLM``) with no spinner, then with ``--busy`` pure-Python spinners.
Printed per round: output tokens/s and inter-token latency for each, and
the loaded figure over the alone one.

    python benchmarks/engine_under_load.py [--preset realistic] [--concurrency 32] [--busy 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from dataclasses import replace

SPIN = "while True:\n    pass"


def measure(direct, concurrency: int, requests_per_client: int, busy: int) -> dict[str, float]:
    from triton_omni_tools.bench.harness import measure_direct_closed_loop

    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    try:
        point = measure_direct_closed_loop(direct, "ar", concurrency, requests_per_client)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    return {"tokens_per_s": point.throughput, "itl_p50_ms": point.summary()["itl_p50_ms"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="realistic")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--busy", type=int, default=3, help="spinning processes beside the engine (default 3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, help="requests per client and measurement (default: the preset's)")
    args = parser.parse_args()

    import torch
    from triton_omni.demo_models import resolve_model
    from triton_omni_tools.bench import PRESETS
    from triton_omni_tools.bench.harness import Direct
    from triton_omni_tools.launcher import vllm_gpu_env

    for key, value in vllm_gpu_env().items():
        os.environ.setdefault(key, value)
    preset = replace(PRESETS[args.preset], workloads=("ar",))
    resolve_model(preset.ar_model)
    requests = args.requests or preset.rounds_for("ar")
    direct = Direct(preset, "cuda" if torch.cuda.is_available() else "cpu")
    try:
        measure(direct, args.concurrency, 1, 0)  # warm-up
        ratios = []
        for round_ in range(1, args.rounds + 1):
            alone = measure(direct, args.concurrency, requests, 0)
            loaded = measure(direct, args.concurrency, requests, args.busy)
            ratios.append(loaded["tokens_per_s"] / alone["tokens_per_s"])
            print(f"round {round_}: alone {alone['tokens_per_s']:,.0f} tok/s, ITL p50 {alone['itl_p50_ms']:.2f} ms; "
                  f"{args.busy} busy {loaded['tokens_per_s']:,.0f} tok/s, ITL p50 {loaded['itl_p50_ms']:.2f} ms; "
                  f"loaded / alone {ratios[-1]:.2f}", flush=True)
        print(f"concurrency {args.concurrency}, {args.busy} busy processes: tokens/s loaded / alone, "
              f"median of {args.rounds}: {statistics.median(ratios):.2f}")
    finally:
        direct.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
