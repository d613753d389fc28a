"""FLUX.2 [dev] at full size on two GPUs, served end to end: its 32 B DiT on GPU 0, its 24 B text
encoder on GPU 1 (`--place diffusion=0 --place ar_encoder=1`, docs/gpu.md), random weights at the
real shapes. Prints the server's start, each GPU's memory in use, and `text_to_image`'s latency at
1024² (after a warm-up request), one request at a time.

Then (unless ``--no-direct``) diffusers' own pipeline with the same placement, by hand as its
users place it: the text encoder's pipeline (no DiT, no VAE) on GPU 1 encodes the prompt
(``encode_prompt``), the embeddings move to GPU 0, and the DiT's pipeline there makes the image
from them (``prompt_embeds``). Both sides time the same requests (prompt, seeds, steps, size),
with the server gone before the pipeline loads (the GPUs hold one side at a time), and it prints
each side's latency and Triton / diffusers.

    python benchmarks/flux2_dev_placed.py [--steps 50] [--requests 2] [--no-direct] [--aa]

The encoder folder (`demo:realistic-flux2-dev-encoder`, about 46 GB) is built into the cache on its
first use, on a GPU, before the server starts.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from triton_omni.demo_models import build_in_memory, resolve_model
from triton_omni_client import OmniClient
from triton_omni_tools.bench.presets import FLUX2_DEV_PLACED
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, TritonServer, free_port
from triton_omni_tools.repository import copy_repositories

PROMPT = "a lighthouse on a cliff at dusk"


ENCODER = FLUX2_DEV_PLACED["ar_encoder"]["parameters"]["model"]
DIT = FLUX2_DEV_PLACED["diffusion"]["parameters"]["model"]
SIZE = 1024


def served(steps: int, guidance: float, requests: int) -> list[float]:
    """Seconds per ``text_to_image`` request through the server, placed as the docs show."""
    with tempfile.TemporaryDirectory() as tmp:
        repositories = copy_repositories(DEFAULT_REPOSITORIES, Path(tmp) / "repos", FLUX2_DEV_PLACED)
        started = time.perf_counter()
        with TritonServer(ServerOptions(
                model_repositories=repositories, http_port=free_port(), grpc_port=free_port(),
                metrics_port=free_port(), model_control_mode="explicit",
                placement=["diffusion=0", "ar_encoder=1"], load_models=["ar_encoder", "diffusion", "text_to_image"],
                log_file=Path(tmp) / "server.log")) as server:
            print(f"server ready in {time.perf_counter() - started:.1f} s")
            client = OmniClient(server.grpc_url)
            options = {"model": "text_to_image", "guidance_scale": guidance, "height": SIZE, "width": SIZE}
            client.generate_image("warm up", num_inference_steps=2, seed=1, **options)
            print(f"GPU memory in use (MiB): {', '.join(gpu_memory_used())}")
            seconds = []
            for seed in range(requests):
                began = time.perf_counter()
                client.generate_image(PROMPT, num_inference_steps=steps, seed=seed, **options)
                seconds.append(time.perf_counter() - began)
                print(f"Triton text_to_image {SIZE}², {steps} steps, guidance {guidance}: {seconds[-1]:.2f} s")
    return seconds


def direct(steps: int, guidance: float, requests: int, rounds: int) -> list[list[float]]:
    """Seconds per image of diffusers' pipeline placed by hand, one list per round: the encoder's
    pipeline on GPU 1, the DiT's on GPU 0 (``torch.cuda.synchronize`` on both before the clock
    stops)."""
    from diffusers import DiffusionPipeline

    encoder_device, dit_device = torch.device("cuda:1"), torch.device("cuda:0")
    encoder = DiffusionPipeline.from_pretrained(resolve_model(ENCODER), transformer=None, vae=None, scheduler=None,
                                                dtype=torch.bfloat16).to(encoder_device)
    pipeline = build_in_memory(DIT, dit_device, torch.bfloat16)
    pipeline.set_progress_bar_config(disable=True)
    print(f"GPU memory in use (MiB): {', '.join(gpu_memory_used())}")

    def generate(prompt: str, steps: int, seed: int) -> None:
        with torch.inference_mode():
            embeds, _ = encoder.encode_prompt(prompt, device=encoder_device)
            pipeline(prompt_embeds=embeds.to(dit_device), guidance_scale=guidance, height=SIZE, width=SIZE,
                     num_inference_steps=steps, generator=torch.Generator(dit_device).manual_seed(seed),
                     output_type="np")
        for device in (encoder_device, dit_device):
            torch.cuda.synchronize(device)

    generate("warm up", 2, 1)
    timed = []
    for _ in range(rounds):
        seconds = []
        for seed in range(requests):
            began = time.perf_counter()
            generate(PROMPT, steps, seed)
            seconds.append(time.perf_counter() - began)
            print(f"diffusers, placed by hand, {SIZE}², {steps} steps, guidance {guidance}: {seconds[-1]:.2f} s")
        timed.append(seconds)
    return timed


def gpu_memory_used() -> list[str]:
    return subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=True).stdout.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--no-direct", action="store_true", help="the server's side only")
    parser.add_argument("--aa", action="store_true",
                        help="the direct side's requests twice: the host against itself (direct / direct)")
    args = parser.parse_args()
    resolve_model(ENCODER)
    triton = served(args.steps, args.guidance, args.requests)
    if args.no_direct:
        return
    diffusers, *again = direct(args.steps, args.guidance, args.requests, 2 if args.aa else 1)
    t, d = statistics.median(triton), statistics.median(diffusers)
    print(f"median latency: Triton {t:.2f} s, diffusers placed by hand {d:.2f} s: Triton / diffusers {t / d:.3f}")
    for seconds in again:
        print(f"A/A: diffusers' second round {statistics.median(seconds):.2f} s: direct / direct "
              f"{statistics.median(seconds) / d:.3f}")


if __name__ == "__main__":
    main()
