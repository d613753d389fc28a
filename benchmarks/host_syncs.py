"""Where a denoising step waits for the GPU: every host synchronisation the
step engine makes while serving requests, counted, with the Python lines that
made it (torch's CUDA sync debug mode).

Why it matters: a step that reads a device value back stops the host from
queuing ahead of the GPU. Over two GPUs driven from two threads (CFG
parallel) each such wait lets the other thread hold the GIL while its GPU
idles, so the syncs per step bound how close two GPUs come to half of one.

    python benchmarks/host_syncs.py                                   # GPU: tiny Qwen-Image, 4 steps
    python benchmarks/host_syncs.py --model demo:tiny-z-image --guidance 0
"""

from __future__ import annotations

import argparse
import collections
import threading
import traceback
import warnings

import torch
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig


def request_values(runner: DiffusionRunner, index: int, steps: int, size: int, guidance: float) -> dict:
    generator = torch.Generator().manual_seed(1000 + index)
    hidden = runner.limits.hidden_size
    values = {"prompt_embeds": torch.randn(16, hidden, generator=generator) * 0.5, "seed": 7 + index,
              "guidance_scale": guidance, "num_inference_steps": steps, "height": size, "width": size}
    if guidance > 1.0:
        values["negative_prompt_embeds"] = torch.randn(12, hidden, generator=generator) * 0.5
    return values


class SyncLog:
    """Counts each distinct stack (our and diffusers' frames) that synchronised."""

    def __init__(self):
        self.stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
        self.lock = threading.Lock()

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = tuple(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                       for f in traceback.extract_stack()[:-1]
                       if "triton_omni" in f.filename or "diffusers" in f.filename)
        with self.lock:
            self.stacks[frames] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo:tiny-qwen-image")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--cfg-device", help="CFG parallel: the negative passes' GPU (e.g. cuda:1)")
    args = parser.parse_args()
    runner = DiffusionRunner(DiffusionRunnerConfig(args.model, device="cuda:0", dtype="bfloat16", batching="step",
                                                   batch_size=4, exact_batching=False,
                                                   cfg_device=args.cfg_device))
    try:
        warm = [runner.submit(runner.parse(request_values(runner, i, 2, args.size, args.guidance)))
                for i in range(args.requests)]
        [f.result() for f in warm]
        log = SyncLog()
        warnings.showwarning = log
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        futures = [runner.submit(runner.parse(request_values(runner, i, args.steps, args.size, args.guidance)))
                   for i in range(args.requests)]
        [f.result() for f in futures]
        torch.cuda.set_sync_debug_mode("default")
    finally:
        runner.close()
    total = sum(log.stacks.values())
    print(f"{args.model}: {args.requests} requests x {args.steps} steps, guidance {args.guidance}: "
          f"{total} host syncs")
    for frames, count in log.stacks.most_common():
        print(f"\n{count:>5} x")
        for frame in frames[-8:]:
            print(f"        {frame}")


if __name__ == "__main__":
    main()
