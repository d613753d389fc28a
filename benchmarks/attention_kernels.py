"""The attention kernels this host runs, at the families' real call shapes: each kernel's time per
call, its TFLOP/s and share of the dense bf16 peak, and how far its output is from PyTorch's SDPA
(the kernel ``attention_backend: auto`` would choose is the fastest whose output matches).

The shapes are one request's attention call in the DiT at its realistic setting (one row; the
heads and head size of the real model; the image or video tokens plus the text tokens):

    python benchmarks/attention_kernels.py                       # every shape, every kernel
    python benchmarks/attention_kernels.py --shapes wan --kernels native,flash_4_hub

A kernel this host cannot run is listed with the reason. FLOPs per call: 4 * tokens² * heads *
head size (the two matmuls, no mask, no causality).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_peaks import device_name, peak_bf16
from triton_omni.diffusion.kernels import ATTENTION_CANDIDATES, usable_backend

# name -> (tokens, heads, head size): one request's call at the family's realistic setting
SHAPES = {
    "qwen-image": (4096 + 256, 24, 128),  # 1024², a prompt of about 256 tokens
    "flux1-dev": (4096 + 512, 24, 128),  # 1024², T5's 512
    "wan": (32760, 12, 128),  # Wan 2.1 T2V-1.3B, 832x480, 81 frames (text is cross-attention)
    "wan2.2-ti2v": (27280, 24, 128),  # Wan 2.2 TI2V-5B, 1280x704, 121 frames
}


def time_call(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reference: torch.Tensor,
              repeats: int) -> tuple[float, float] | Exception:
    """(seconds per call, the largest difference from SDPA's output), or why it cannot run."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    try:
        backend = usable_backend(name)
        out = dispatch_attention_fn(q, k, v, backend=backend)  # the first call compiles, where a kernel is JIT
        difference = float((out.float() - reference.float()).abs().max())
        for _ in range(3):
            dispatch_attention_fn(q, k, v, backend=backend)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dispatch_attention_fn(q, k, v, backend=backend)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats, difference
    except Exception as exc:  # a kernel this host lacks: listed with the reason
        return exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kernels", default=",".join(ATTENTION_CANDIDATES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_kernels.py times GPU kernels: no CUDA device here")
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    device, peak = device_name(), peak_bf16(device_name())
    print(f"attention kernels on {device}, bf16, one request's call per family (tokens, heads, head size)")
    rows = []
    for shape in args.shapes.split(","):
        tokens, heads, head_dim = SHAPES[shape]
        generator = torch.Generator("cuda").manual_seed(0)
        q, k, v = (torch.randn(1, tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
                   for _ in range(3))
        reference = dispatch_attention_fn(q, k, v, backend=AttentionBackendName.NATIVE)
        flops = 4 * tokens * tokens * heads * head_dim
        print(f"{shape} ({tokens}, {heads}, {head_dim}): {flops / 1e12:.2f} TFLOP a call")
        for name in args.kernels.split(","):
            found = time_call(name, q, k, v, reference, args.repeats)
            if isinstance(found, Exception):
                print(f"  {name:>20}  not here: {type(found).__name__}: {str(found).splitlines()[0][:110]}")
                continue
            seconds, difference = found
            share = f"{flops / seconds / peak:6.1%}" if peak else "     -"
            print(f"  {name:>20} {seconds * 1e3:9.3f} ms {flops / seconds / 1e12:7.1f} TFLOP/s {share} of the "
                  f"bf16 peak, max difference from SDPA {difference:.4f}")
            rows.append({"shape": shape, "kernel": name, "seconds": seconds, "tflops": flops / seconds / 1e12,
                         "max_difference": difference})
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
