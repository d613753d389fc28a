"""Qwen-Image over two GPUs against one GPU, the same requests, the step
engine in this process:

- ``--mode cfg``: CFG parallel, the negative prompts' passes on the second GPU;
- ``--mode sp``: sequence parallel, each forward of the transformer over both
  GPUs, each with half of the tokens (diffusers' Ulysses attention).

One GPU runs first and is freed (two copies of the 20 B DiT do not fit one
80 GB GPU), then the two-GPU runner. Prints the latency at concurrency 1 (and
at N), the ratio, and how far the images are apart (0: bit-exact).

    python benchmarks/parallel.py --mode cfg [--size 1024] [--steps 50] [--concurrency 1,4]   # two GPUs
    python benchmarks/parallel.py --mode sp --size 2048
    python benchmarks/parallel.py --mode cfg --compile    # both sides with the DiT's blocks compiled

``--compile``: ``compile: blocks`` on both sides (CFG parallel compiles its second GPU's copy
too), so the two GPUs are compared with one GPU as each would be served. The warm-up takes the
compile time.
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


# the runner's settings for each way over two GPUs
MODES = {"cfg": {"cfg_device": "cuda:1"}, "sp": {"sp_devices": ("cuda:1",)}}
NAMES = {"cfg": "CFG parallel", "sp": "sequence parallel"}


def measure(parallel: dict, levels: list[int], size: int, steps: int, rounds: int,
            compile: bool = False, kernels: dict | None = None) -> tuple[dict, dict]:
    """({concurrency: seconds per round}, {concurrency: request 0's image}); ``kernels``: the
    runner's quantization and attention_backend."""
    runner = DiffusionRunner(DiffusionRunnerConfig(MODEL, device="cuda:0", dtype="bfloat16", batching="step",
                                                   batch_size=max(levels), exact_batching=False,
                                                   compile="blocks" if compile else "off",
                                                   limits={"max_size": max(1024, size)}, **parallel,
                                                   **(kernels or {})))
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
    parser.add_argument("--mode", choices=sorted(MODES), default="cfg")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--concurrency", default="1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="both sides compile the DiT's blocks")
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none", help="both sides' DiT")
    parser.add_argument("--attention-backend", default="auto", help="both sides' attention kernel")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    kernels = {"quantization": args.quantization, "attention_backend": args.attention_backend}
    one, one_images = measure({}, levels, args.size, args.steps, args.rounds, args.compile, kernels)
    two, two_images = measure(MODES[args.mode], levels, args.size, args.steps, args.rounds, args.compile, kernels)
    name = NAMES[args.mode]
    print(f"Qwen-Image {args.size}², {args.steps} steps, true CFG 4.0, on {torch.cuda.get_device_name(0)}, "
          f"DiT blocks {'compiled' if args.compile else 'eager'}, quantization {args.quantization}, "
          f"attention {args.attention_backend}")
    print(f"{'conc':>4} {'one GPU s':>10} {name + ' s':>22} {'ratio':>6}  image difference (max, of 255)")
    points = []
    for c in levels:
        a, b = statistics.median(one[c]), statistics.median(two[c])
        difference = int((one_images[c].int() - two_images[c].int()).abs().max())
        points.append({"concurrency": c, "one_gpu_s": one[c], "two_gpus_s": two[c], "ratio": b / a,
                       "max_difference": difference})
        print(f"{c:>4} {a:>10.3f} {b:>22.3f} {b / a:>6.3f}  {difference}")
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": args.mode, "size": args.size, "steps": args.steps,
                                               "compile": args.compile, "points": points, "kernels": kernels,
                                               "date": time.strftime("%Y-%m-%d"),
                                               "device": torch.cuda.get_device_name(0)}, indent=2))


if __name__ == "__main__":
    main()
