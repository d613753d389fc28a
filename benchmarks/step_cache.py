"""Step caching's speed-up and what it costs in the image, measured on the
step engine (the diffusion runner in this process, step batching), the
same requests with the cache off and on:

* concurrency 1: one request's latency, off over on;
* concurrency N: N requests submitted at once (seeds differ), images/s on over off.

Beside each speed-up it prints the quality cost: PSNR and the mean absolute
pixel difference (of 255) of each cached image against the uncached image of
the same request. On random weights this is a proxy: a trained model's
residuals change differently from step to step, and so do its skips.

    .venv/bin/python benchmarks/step_cache.py --family qwen-image                      # CPU, tiny pipelines
    python benchmarks/step_cache.py --family qwen-image --preset realistic --threshold 0.1   # GPU
    python benchmarks/step_cache.py --family qwen-image-edit --preset realistic --threshold 0.1  # an edit of 1024²
    python benchmarks/step_cache.py --family flux1-dev --preset realistic --threshold 0.1 --compile --quantization fp8

``--compile``, ``--quantization fp8`` and ``--attention-backend`` serve the DiT as ``diffusion``'s
parameters of those names do (the uncached requests replay its CUDA graphs; a cached step's passes,
which decide per request, run the compiled blocks without them).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.families import Guidance
from triton_omni_tools.bench.presets import edit_picture

SETUPS = {  # (model, size, steps, guidance): as benchmarks/families.py
    ("qwen-image", "tiny"): ("demo:tiny-qwen-image", 32, 10, 4.0),
    ("z-image", "tiny"): ("demo:tiny-z-image", 32, 10, 4.0),
    ("qwen-image", "realistic"): ("demo:realistic-qwen-image", 1024, 50, 4.0),
    ("z-image", "realistic"): ("demo:realistic-z-image", 1024, 8, 0.0),
    ("qwen-image-edit", "tiny"): ("demo:tiny-qwen-image-edit", 32, 10, 4.0),
    ("qwen-image-edit", "realistic"): ("demo:realistic-qwen-image-edit", 1024, 50, 4.0),
    ("flux1-dev", "tiny"): ("demo:tiny-flux1-dev", 32, 10, 3.5),
    ("flux1-dev", "realistic"): ("demo:realistic-flux1-dev", 1024, 28, 3.5),
}
TOKENS = 64
EDITS = {"demo:tiny-qwen-image-edit", "demo:realistic-qwen-image-edit"}  # every request edits an input image


def request(runner: DiffusionRunner, index: int, size: int, steps: int, guidance: float, step_cache: str):
    generator = torch.Generator().manual_seed(1000 + index)
    hidden = runner.limits.hidden_size
    values = {"prompt_embeds": torch.randn(TOKENS, hidden, generator=generator) * 0.5, "seed": 7 + index,
              "num_inference_steps": steps, "guidance_scale": guidance, "height": size, "width": size,
              "step_cache": step_cache}
    if runner.config.model in EDITS:
        values["images"] = [edit_picture()]
    family = runner.family
    if family.pooled_size():  # FLUX.1: CLIP's pooled vector beside the sequence
        values["pooled_prompt_embeds"] = torch.randn(family.pooled_size(), generator=generator)
    if guidance > 0 and family.capabilities.guidance is not Guidance.DISTILLED:  # distilled: no negative
        values["negative_prompt_embeds"] = torch.randn(TOKENS * 3 // 4, hidden, generator=generator) * 0.5
    return runner.parse(values)


def run(runner: DiffusionRunner, concurrency: int, setup: tuple, step_cache: str) -> tuple[float, list, list]:
    """(seconds, images, (computed, skipped) per request) of ``concurrency`` requests submitted at once."""
    _, size, steps, guidance = setup
    counts: list = [None] * concurrency
    started = time.perf_counter()
    futures = [runner.submit(request(runner, i, size, steps, guidance, step_cache),
                             on_cached=lambda c, s, i=i: counts.__setitem__(i, (c, s))) for i in range(concurrency)]
    images = [future.result() for future in futures]
    return time.perf_counter() - started, images, counts


def quality(cached: torch.Tensor, plain: torch.Tensor) -> tuple[float, float]:
    """(PSNR in dB, mean absolute difference of 255) of a cached image against the uncached one."""
    difference = cached.float() - plain.float()
    mse = float((difference**2).mean())
    return (math.inf if mse == 0 else 10 * math.log10(255**2 / mse)), float(difference.abs().mean())


def measure(runner: DiffusionRunner, concurrency: int, setup: tuple, method: str) -> dict:
    run(runner, concurrency, (*setup[:2], 2, *setup[3:]), "off")  # warm-up: kernels chosen, memory allocated
    off_s, plain, _ = run(runner, concurrency, setup, "off")
    on_s, cached, counts = run(runner, concurrency, setup, method)
    qualities = [quality(c, p) for c, p in zip(cached, plain, strict=True)]
    return {"concurrency": concurrency, "off_s": off_s, "on_s": on_s, "speedup": off_s / on_s,
            "skipped": [s for _, s in counts], "steps": setup[2],
            "psnr_db": min(q[0] for q in qualities), "mean_abs_diff": max(q[1] for q in qualities)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted({family for family, _ in SETUPS}), required=True)
    parser.add_argument("--preset", choices=["tiny", "realistic"], default="tiny")
    parser.add_argument("--method", default="first_block", help="the step cache's method (step_cache.py)")
    parser.add_argument("--threshold", type=float, help="its threshold (default: the method's)")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated")
    parser.add_argument("--compile", action="store_true", help="compile: blocks (the DiT's)")
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    setup = SETUPS[(args.family, args.preset)]
    cuda = args.preset == "realistic"
    method = args.method if args.threshold is None else f"{args.method}:{args.threshold:g}"
    levels = [int(c) for c in args.concurrency.split(",")]
    runner = DiffusionRunner(DiffusionRunnerConfig(
        setup[0], device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32", batching="step",
        batch_size=max(levels), exact_batching=False, limits={"max_size": max(1024, setup[1])},
        compile="blocks" if args.compile else "off", quantization=args.quantization,
        attention_backend=args.attention_backend))
    try:
        points = [measure(runner, c, setup, method) for c in levels]
    finally:
        runner.close()
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"{args.family} ({args.preset}: {setup[1]}², {setup[2]} steps, guidance {setup[3]}), step cache {method}, "
          f"on {device}; compile {'blocks' if args.compile else 'off'}, {args.quantization}, attention "
          f"{args.attention_backend}")
    print(f"{'conc':>4} {'off s':>9} {'on s':>9} {'speed-up':>9} {'min PSNR dB':>12} {'max mean |diff|':>16}  "
          "steps skipped per request")
    for p in points:
        print(f"{p['concurrency']:>4} {p['off_s']:>9.3f} {p['on_s']:>9.3f} {p['speedup']:>9.3f} {p['psnr_db']:>12.2f} "
              f"{p['mean_abs_diff']:>16.3f}  {p['skipped']} of {p['steps']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"family": args.family, "preset": args.preset, "method": method,
                                               "device": device, "date": time.strftime("%Y-%m-%d"),
                                               "points": points}, indent=2))


if __name__ == "__main__":
    main()
