"""The attention kernels this host runs, at the families' real call shapes: each kernel's time per
call, its TFLOP/s and share of the dense bf16 peak, and how far its output is from PyTorch's SDPA
(the kernel ``attention_backend: auto`` would choose is the fastest whose output matches).

The shapes are one request's attention call in the DiT at its realistic setting (one row; the
heads and head size of the real model; the image or video tokens plus the text tokens):

    python benchmarks/attention_kernels.py                       # every shape, every kernel
    python benchmarks/attention_kernels.py --shapes wan --kernels native,flash_4_hub,_flash_3_hub

A kernel this host cannot run is listed with the reason. FLOPs per call: 4 * tokens² * heads *
head size (the two matmuls, no mask, no causality).

``--fa4-tiles``: FlashAttention-4's forward at each shape under other tile sizes than its own
choice (on Hopper 128x128 at head size 128; FlashAttention-3's C++ kernels take 128x176 there),
each ``MxN`` optionally with ``:nors`` (P·V's operand from shared memory, not registers) or
``:nool`` (no overlap inside a warp group): whether the package's default leaves time at these
calls' shapes.

    python benchmarks/attention_kernels.py --shapes wan,flux1-dev --kernels flash_4_hub \
        --fa4-tiles 128x128,128x176,128x192,128x160,192x128,128x176:nors
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


def timed(call, reference: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(seconds per ``call()``, the largest difference of its output from ``reference``): the first
    call compiles where a kernel is JIT, three more warm up, then ``repeats`` timed on the GPU."""
    difference = float((call().float() - reference.float()).abs().max())
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats, difference


def time_call(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reference: torch.Tensor,
              repeats: int) -> tuple[float, float] | Exception:
    """(seconds per call, the largest difference from SDPA's output), or why it cannot run."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    try:
        backend = usable_backend(name)
        return timed(lambda: dispatch_attention_fn(q, k, v, backend=backend), reference, repeats)
    except Exception as exc:  # a kernel this host lacks: listed with the reason
        return exc


def fa4_tile(spec: str) -> dict:
    """``128x176:nors`` as FlashAttention-4's forward arguments."""
    tile, *flags = spec.split(":")
    m, n = (int(side) for side in tile.split("x"))
    unknown = set(flags) - {"nors", "nool"}
    if unknown:
        raise SystemExit(f"--fa4-tiles {spec!r}: unknown flag {sorted(unknown)[0]!r} (nors, nool)")
    return {"tile_mn": (m, n), **({"mma_pv_is_rs": False} if "nors" in flags else {}),
            **({"intra_wg_overlap": False} if "nool" in flags else {})}


def time_fa4_tile(spec: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reference: torch.Tensor,
                  repeats: int) -> tuple[float, float] | Exception:
    """As ``time_call``, FlashAttention-4's forward with the tile ``spec`` (its package's own launcher,
    which its public function calls with the tile it chooses)."""
    try:
        from flash_attn.cute.interface import _flash_attn_fwd

        arguments = fa4_tile(spec)
        return timed(lambda: _flash_attn_fwd(q, k, v, **arguments)[0], reference, repeats)
    except Exception as exc:  # a tile the kernel refuses, or no package: listed with the reason
        return exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kernels", default=",".join(ATTENTION_CANDIDATES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--fa4-tiles", default="", help="comma-separated FlashAttention-4 tiles, MxN[:nors][:nool]")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    tiles = [spec for spec in args.fa4_tiles.split(",") if spec]
    for spec in tiles:
        fa4_tile(spec)  # a malformed one refused before any GPU work
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
        runs = [(name, time_call, name) for name in args.kernels.split(",")]
        runs += [(f"fa4 {spec}", time_fa4_tile, spec) for spec in tiles]
        for name, timer, which in runs:
            found = timer(which, q, k, v, reference, args.repeats)
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
