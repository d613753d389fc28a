"""How far apart do two identical vLLM engines measure on this host? The
bench's direct side of `ar` (or of `ar_encoder`) twice (engines A and B: the
same model, the same arguments, both in this process), in pairs, the order
alternating, as the bench pairs direct with Triton.

Why: `ar` through Triton is held against a 0.95 ratio to direct vLLM, and
each engine core is a Python loop that steps as fast as the vCPU under it;
on shared VMs vCPUs differ and slow each other. Two
engines with nothing between them and their clients but which vCPUs they
got give the ratio this host can resolve. Printed per concurrency: each
pair's B / A throughput (output tokens/s; prompts/s for `ar_encoder`),
their median, and each side's ITL p50 (text generation).

    python benchmarks/engine_aa.py [--workload ar|ar_encoder] [--preset realistic] [--concurrency 8,32,64]
        [--pairs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace


def measure(direct, workload: str, concurrency: int, rounds: int) -> dict[str, float]:
    from triton_omni_tools.bench.harness import measure_direct_closed_loop

    summary = measure_direct_closed_loop(direct, workload, concurrency, rounds).summary()
    return {key: summary[key] for key in ("throughput_per_s", "itl_p50_ms", "ttft_p50_ms", "p50_ms", "cores")
            if key in summary}


def describe(figures: dict[str, float], unit: str) -> str:
    detail = f"ITL p50 {figures['itl_p50_ms']:.2f} ms" if "itl_p50_ms" in figures else f"p50 {figures['p50_ms']:.1f} ms"
    return f"{figures['throughput_per_s']:,.0f} {unit} ({detail})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("ar", "ar_encoder"), default="ar")
    parser.add_argument("--preset", default="realistic")
    parser.add_argument("--concurrency", default="8,32,64")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", help="write every pair's figures here (JSON)")
    args = parser.parse_args()

    import torch
    from triton_omni.demo_models import resolve_model
    from triton_omni_tools.bench import PRESETS
    from triton_omni_tools.bench.harness import Direct
    from triton_omni_tools.launcher import vllm_gpu_env

    for key, value in vllm_gpu_env().items():
        os.environ.setdefault(key, value)
    preset = replace(PRESETS[args.preset], workloads=(args.workload,))
    unit = "tok/s" if args.workload == "ar" else "prompts/s"
    resolve_model(preset.ar_model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engines = {"A": Direct(preset, device), "B": Direct(preset, device)}
    records = []
    try:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            ratios = []
            for turn in range(args.pairs):
                order = ("A", "B") if turn % 2 == 0 else ("B", "A")
                pair = {name: measure(engines[name], args.workload, concurrency, preset.rounds_for(args.workload))
                        for name in order}
                ratios.append(pair["B"]["throughput_per_s"] / pair["A"]["throughput_per_s"])
                records.append({"concurrency": concurrency, "turn": turn, "order": order, **pair})
                print(f"c={concurrency} pair {turn + 1} ({' then '.join(order)}): "
                      f"A {describe(pair['A'], unit)}, B {describe(pair['B'], unit)}, B / A {ratios[-1]:.2f}",
                      flush=True)
            print(f"c={concurrency}: B / A median {statistics.median(ratios):.2f}, "
                  f"range {min(ratios):.2f} to {max(ratios):.2f}", flush=True)
    finally:
        for direct in engines.values():
            direct.close()
        if args.out:
            with open(args.out, "w") as file:
                json.dump(records, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
