"""How long a vLLM engine takes to start on the CPU, eager (this project's
default there) against compiled (vLLM's own default), in pairs whose order
alternates. vLLM on the CPU compiles the model at every start, as it cannot
load its compile cache back; every server start of ``make serve`` and of the
test suite waits for each engine's start.

    python benchmarks/engine_start.py                  # the demo's tiny Qwen2, 2 pairs
    python benchmarks/engine_start.py --model PATH --pairs 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from triton_omni.ar import ArRunner, ArRunnerConfig
from triton_omni.demo_models import build_all

SIDES = {"eager": {}, "compiled": {"enforce_eager": False}}  # eager: no engine_args, the default


def start_seconds(model: str, engine_args: dict) -> float:
    """From the runner's construction until its engine is up."""
    began = time.monotonic()
    runner = ArRunner(ArRunnerConfig(model, "generate", engine="vllm", engine_args=engine_args))
    try:
        return time.monotonic() - began
    finally:
        runner.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo:tiny-qwen2")
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    build_all()
    ratios = []
    for turn in range(args.pairs):
        order = list(SIDES) if turn % 2 == 0 else list(reversed(SIDES))
        seconds = {side: start_seconds(args.model, SIDES[side]) for side in order}
        ratios.append(seconds["eager"] / seconds["compiled"])
        print(f"pair {turn + 1} ({' then '.join(order)}): eager {seconds['eager']:.1f} s, "
              f"compiled {seconds['compiled']:.1f} s, eager / compiled {ratios[-1]:.2f}", flush=True)
    print(f"eager / compiled start: median {statistics.median(ratios):.2f}, "
          f"range {min(ratios):.2f} to {max(ratios):.2f}")


if __name__ == "__main__":
    main()
