"""One forward pass of a family's DiT, timed under each way of running its blocks: where CUDA
graphs pay on top of ``compile: blocks``, and what FP8 and the attention kernel give, per step.

The forward's arguments are the ones the family's own pipeline passes its DiT (captured from one
pipeline call, unguided, with ``--rows`` prompts); each mode then replays that forward:

- ``eager``: the blocks as loaded;
- ``default``: ``compile: blocks`` as served (torch.compile of each repeated block, inductor);
- ``graphs``: the same with the whole forward replayed as one CUDA graph, as served
  (``cuda_graphs: true``, the runner's ``cuda_graphs.GraphedDenoiser``; GPU only);
- ``reduce-overhead``: ``default`` with torch.compile's own CUDA graphs (a graph per block and
  shape, ``torch.compiler.cudagraph_mark_step_begin()`` before each forward);
- ``max-autotune-no-cudagraphs``: inductor's autotuned matmul and attention templates.

Prints milliseconds per forward, the ratio against the first line of its batch size (the first
attention kernel's first mode), the MFU (``Family.forward_flops`` over the time, of the GPU's
dense bf16 peak) and how far its prediction is from that first line's (relative L2), for each
attention kernel listed (``auto``: the one a served model would choose).

    .venv/bin/python benchmarks/dit_step.py --family qwen-image --modes eager,default     # CPU, tiny
    python benchmarks/dit_step.py --family qwen-image --preset realistic --size 1024 --rows 1,4
    python benchmarks/dit_step.py --family z-image --preset realistic --size 512 --quantization fp8 \\
        [--fp8-scales tensor]
    python benchmarks/dit_step.py --family qwen-image --preset realistic --attention-backend native,auto
    python benchmarks/dit_step.py --family qwen-image --preset realistic --quantization fp8 --modes eager --profile 25
    python benchmarks/dit_step.py --family wan --preset realistic --modes default --profile 25   # 832x480, 81 frames
    python benchmarks/dit_step.py --family wan --preset realistic --modes default --projections unfused,fused
    python benchmarks/dit_step.py --family wan --preset realistic --rows 2 --modes default \\
        --projections fused,gelu-epilogue

``--profile N``: after each mode's timing, one more forward under ``torch.profiler``, and its N
kernels that took the most device time, with each kind's share of the forward (matmuls, attention,
FP8's own casts and scales, norms, the rest): where the time of a forward goes, and what the
quantization itself costs.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from gpu_peaks import device_name, peak_bf16
from triton_omni.demo_models import build_in_memory, resolve_model
from triton_omni.diffusion.cuda_graphs import GraphedDenoiser
from triton_omni.diffusion.kernels import (
    Fp8Plan,
    NetworkKernels,
    fuse_gelu_epilogues,
    fuse_projections,
    installed_kernel,
    resolve_attention,
)
from triton_omni.families import family_of

MODELS = {"qwen-image": "qwen-image", "z-image": "z-image", "flux1-dev": "flux1-dev", "flux2-klein": "flux2-klein",
          "wan": "wan"}
REALISTIC_NAMES = {"wan": "wan2.1-1.3b"}  # where the realistic demo's name is not the tiny one's
MODES = ("eager", "default", "graphs", "reduce-overhead", "max-autotune-no-cudagraphs")
TEXT_TOKENS = 128


def pipeline_of(family: str, preset: str, device: torch.device, dtype: torch.dtype):
    if preset == "realistic":
        name = f"demo:realistic-{REALISTIC_NAMES.get(family, MODELS[family])}"
        return build_in_memory(name, device, dtype)
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(resolve_model(f"demo:tiny-{MODELS[family]}"), torch_dtype=dtype).to(device)


def captured_forward(pipeline, family, rows: int, shape: tuple[int, int, int], device: torch.device,
                     dtype: torch.dtype):
    """(args, kwargs, text tokens) of the DiT's first forward in an unguided pipeline call at
    ``shape`` (height, width, frames: a video's; 1 for an image). A prompt is as many text tokens
    as its pipeline pads to (Wan: 512), else ``TEXT_TOKENS``."""
    captured: dict = {}

    def hook(module, args, kwargs):
        captured.setdefault("call", (args, kwargs))

    height, width, frames = shape
    text = family.recipe.padded_to or TEXT_TOKENS
    embeds = torch.randn(rows, text, family.hidden_size(), device=device, dtype=dtype) * 0.5
    kwargs = {"prompt_embeds": embeds, "guidance_scale": 1.0} | ({"num_frames": frames} if family.output.video else {})
    if family.name == "qwen_image":
        kwargs["prompt_embeds_mask"] = torch.ones(rows, text, dtype=torch.long, device=device)
    elif family.name == "flux1":
        kwargs["pooled_prompt_embeds"] = torch.randn(rows, family.pooled_size(), device=device, dtype=dtype)
    elif family.name == "z_image":
        kwargs = {"prompt_embeds": list(embeds), "guidance_scale": 0.0}
    handle = family.network.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            pipeline(num_inference_steps=1, height=height, width=width, output_type="latent", **kwargs)
    finally:
        handle.remove()
    return (*captured["call"], text)


def set_mode(network: torch.nn.Module, mode: str) -> GraphedDenoiser | None:
    """The blocks' forward for ``mode``, from the eager one (the caches of the last mode dropped);
    for ``graphs``, the graphs installed around the network's forward (``remove()`` them after)."""
    torch._dynamo.reset()
    for block in network.modules():
        if type(block).__name__ in network._repeated_blocks:
            block.__dict__.pop("forward", None)
            if mode != "eager":
                compiled = None if mode in ("default", "graphs") else mode
                block.forward = torch.compile(block.forward, mode=compiled)
    return GraphedDenoiser(network) if mode == "graphs" else None


def time_forward(network, args, kwargs, mode: str, repeats: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """Seconds per forward: three warm-up calls (compiling, capturing), then ``repeats`` timed; and
    the last forward's prediction."""
    def forward():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return network(*args, **kwargs)

    with torch.inference_mode():
        for _ in range(3):
            out = forward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            out = forward()
        if device.type == "cuda":
            torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / repeats
    return seconds, (out[0] if isinstance(out, tuple) else out.sample).float().clone()


# A kernel's kind, by its name (the first match): what the profile's shares are of. FP8's own work
# comes before the matmuls: inductor names a kernel that computes an activation's scale and cast
# (fused into the norm or GELU before it) after the `_scaled_mm` it feeds.
KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("fp8 casts and scales", ("float8", "fp8", "e4m3", "amax", "quant", "abs_", "reciprocal", "clamp")),
    ("matmul", ("gemm", "sm90_", "cutlass", "nvjet", "scaled_mm", "xmma", "matmul", "addmm", "aten::mm", "bmm")),
    ("norms", ("norm",)),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, marks in KINDS if any(mark in name for mark in marks)), "the rest")


def profile_forward(network, args, kwargs, mode: str, top: int, device: torch.device) -> None:
    """One forward under the profiler (after ``time_forward``'s warm-up): its top kernels (on a CPU,
    its top operators) and each kind's share of the device time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        network(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
    spent = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = [(e.key, getattr(e, spent), e.count) for e in prof.key_averages() if getattr(e, spent) > 0]
    total = sum(us for _, us, _ in kernels) or 1.0
    shares: dict[str, float] = {}
    for name, us, _ in kernels:
        shares[kind_of(name)] = shares.get(kind_of(name), 0.0) + us
    print(f"  profile of one forward ({mode}): {total / 1e3:.2f} ms of kernels; "
          + ", ".join(f"{kind} {us / total:.1%}" for kind, us in sorted(shares.items(), key=lambda s: -s[1])))
    for name, us, count in sorted(kernels, key=lambda k: -k[1])[:top]:
        print(f"  {us / 1e3:>9.3f} ms {us / total:>6.1%} {count:>5}x  {kind_of(name):<21} {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(MODELS), required=True)
    parser.add_argument("--preset", choices=["tiny", "realistic"], default="tiny")
    parser.add_argument("--size", help="image side, or WIDTHxHEIGHT (default: 1024 realistic, 32 tiny; a "
                        "video: 832x480 realistic)")
    parser.add_argument("--frames", type=int, help="a video's frames (default: its pipeline's, 5 tiny)")
    parser.add_argument("--rows", default="1", help="comma-separated batch sizes")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none")
    parser.add_argument("--fp8-scales", choices=["row", "tensor"], default="row", help="FP8's scales (fp8_scales)")
    parser.add_argument("--attention-backend", default="auto", help="comma-separated kernels, each timed")
    parser.add_argument("--projections", default="unfused",
                        help="unfused, fused (fuse_projections), gelu-epilogue (then each tanh GELU in its "
                             "projection's matmul, fuse_gelu_epilogues; GPU) or several: each timed, in that order")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after each mode, profile one forward and print its N costliest kernels")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    logging.getLogger("triton_omni").setLevel(logging.INFO)  # what `auto` timed
    logging.basicConfig(format="%(message)s")
    device = torch.device("cuda" if args.preset == "realistic" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipeline = pipeline_of(args.family, args.preset, device, dtype)
    family = family_of(pipeline)
    realistic, video = args.preset == "realistic", family.output.video
    default_size = "832x480" if realistic and video else "1024" if realistic else "32"
    width, _, height = (args.size or default_size).partition("x")
    frames = (args.frames or (family.output.default_frames if realistic else 5)) if video else 1
    shape = (int(height or width), int(width), frames)
    network = family.network
    heads, head_dim = family.attention_shape()
    attentions = list(dict.fromkeys(resolve_attention(name, device, dtype, heads, head_dim, family.attention_masked)
                                    for name in args.attention_backend.split(",")))  # `auto` may be one listed
    plan = Fp8Plan(tuple(network._repeated_blocks), family.fp8_kept, args.fp8_scales) \
        if args.quantization == "fp8" else None
    NetworkKernels(plan).apply(network)
    peak = peak_bf16(device_name())
    print(f"{args.family} ({args.preset}) {shape[1]}x{shape[0]}" + (f", {frames} frames" if video else "")
          + f", on {device_name()}, {dtype}, quantization {args.quantization}"
          + (f" (scales per {args.fp8_scales})" if plan else "") + ", "
          f"{family.recipe.padded_to or TEXT_TOKENS} text tokens")
    print(f"{'rows':>4} {'attention':>14} {'mode':>28} {'ms/forward':>11} {'/ first':>8} {'MFU':>6} "
          f"{'from first':>10}")
    states = args.projections.split(",")
    if unknown := set(states) - {"unfused", "fused", "gelu-epilogue"}:
        parser.error(f"--projections: unfused, fused, gelu-epilogue, not {', '.join(sorted(unknown))}")
    if "fused" in states and not family.capabilities.fused_projections:
        parser.error(f"--projections fused: the {family.name} family's attention does not take fused projections")
    points, baselines, references, calls = [], {}, {}, {}
    for projections in states:
        if projections == "fused":  # in place, for good: the unfused layers are dropped
            print(f"fuse_projections: {fuse_projections(network)} attention layers fused")
        if projections == "gelu-epilogue":  # in place, for good, on top of the ways before it
            print(f"fuse_gelu_epilogues: {fuse_gelu_epilogues(network)} feed-forward GELUs in their matmuls")
        for rows in (int(r) for r in args.rows.split(",")):
            if rows not in calls:  # one forward's inputs for every way, so their predictions compare
                calls[rows] = captured_forward(pipeline, family, rows, shape, device, dtype)
            call_args, call_kwargs, text = calls[rows]
            flops = family.forward_flops(family.image_tokens(*shape), text, rows)
            for attention in attentions:
                installed_kernel(attention)
                network.set_attention_backend(attention)
                for mode in args.modes.split(","):
                    if mode == "graphs" and device.type != "cuda":
                        continue  # CUDA graphs need a GPU
                    graphs = set_mode(network, mode)
                    s, prediction = time_forward(network, call_args, call_kwargs, mode, args.repeats, device)
                    baseline = baselines.setdefault(rows, s)
                    reference = references.setdefault(rows, prediction)  # the first line's prediction
                    distance = ((prediction - reference).norm() / reference.norm()).item()
                    mfu = f"{flops / s / peak:.1%}" if peak else "-"
                    print(f"{rows:>4} {attention:>14} {mode + ', ' + projections:>28} {s * 1e3:>11.2f} "
                          f"{s / baseline:>8.3f} {mfu:>6} {distance:>10.2e}", flush=True)
                    if args.profile:  # before the graphs are removed: the forward as timed
                        profile_forward(network, call_args, call_kwargs, mode, args.profile, device)
                    if graphs is not None:
                        graphs.remove()
                    points.append({"rows": rows, "attention": attention, "mode": mode, "projections": projections,
                                   "seconds": s, "ratio_to_first": s / baseline, "distance_from_first": distance,
                                   "mfu": flops / s / peak if peak else None})
    if args.json:
        Path(args.json).write_text(json.dumps({"family": args.family, "preset": args.preset, "shape": shape,
                                               "quantization": args.quantization,
                                               "device": device_name(), "date": time.strftime("%Y-%m-%d"),
                                               "points": points}, indent=2))


if __name__ == "__main__":
    main()
