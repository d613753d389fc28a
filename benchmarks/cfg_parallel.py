"""CFG parallel against one GPU: Qwen-Image's negative prompts' passes on a
second GPU, the same requests, the step engine in this process. One GPU runs
first and is freed (two copies of the 20 B DiT do not fit one 80 GB GPU),
then the two-GPU runner. Prints the latency at concurrency 1 (and images/s
at N), the ratio, and how far the images are apart (0: bit-exact).

    python benchmarks/cfg_parallel.py [--size 1024] [--steps 50] [--concurrency 1,4]   # two GPUs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig

MODEL = "demo:realistic-qwen-image"


def values(runner: DiffusionRunner, index: int, size: int, steps: int) -> dict:
    generator = torch.Generator().manual_seed(1000 + index)
    hidden = runner.limits.hidden_size
    return {"prompt_embeds": torch.randn(64, hidden, generator=generator) * 0.5,
            "negative_prompt_embeds": torch.randn(48, hidden, generator=generator) * 0.5, "seed": 7 + index,
            "guidance_scale": 4.0, "num_inference_steps": steps, "height": size, "width": size}


def measure(cfg_device: str | None, levels: list[int], size: int, steps: int, rounds: int) -> tuple[dict, dict]:
    """({concurrency: seconds per round}, {concurrency: request 0's image})."""
    runner = DiffusionRunner(DiffusionRunnerConfig(MODEL, device="cuda:0", dtype="bfloat16", batching="step",
                                                   batch_size=max(levels), exact_batching=False,
                                                   limits={"max_size": max(1024, size)}, cfg_device=cfg_device))
    seconds, first = {}, {}
    try:
        for c in levels:
            [f.result() for f in [runner.submit(runner.parse(values(runner, i, size, 2))) for i in range(c)]]
            seconds[c] = []
            for _ in range(rounds):
                started = time.perf_counter()
                images = [f.result() for f in [runner.submit(runner.parse(values(runner, i, size, steps)))
                                               for i in range(c)]]
                seconds[c].append(time.perf_counter() - started)
            first[c] = images[0]
    finally:
        runner.close()
        del runner
        torch.cuda.empty_cache()
    return seconds, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--concurrency", default="1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    one, one_images = measure(None, levels, args.size, args.steps, args.rounds)
    two, two_images = measure("cuda:1", levels, args.size, args.steps, args.rounds)
    print(f"Qwen-Image {args.size}², {args.steps} steps, true CFG 4.0, on {torch.cuda.get_device_name(0)}")
    print(f"{'conc':>4} {'one GPU s':>10} {'CFG parallel s':>15} {'ratio':>6}  image difference (max, of 255)")
    points = []
    for c in levels:
        a, b = statistics.median(one[c]), statistics.median(two[c])
        difference = int((one_images[c].int() - two_images[c].int()).abs().max())
        points.append({"concurrency": c, "one_gpu_s": one[c], "cfg_parallel_s": two[c], "ratio": b / a,
                       "max_difference": difference})
        print(f"{c:>4} {a:>10.3f} {b:>15.3f} {b / a:>6.3f}  {difference}")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "steps": args.steps, "points": points,
                                               "date": time.strftime("%Y-%m-%d"),
                                               "device": torch.cuda.get_device_name(0)}, indent=2))


if __name__ == "__main__":
    main()
