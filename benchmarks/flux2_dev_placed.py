"""FLUX.2 [dev] at full size on two GPUs, served end to end: its 32 B DiT on GPU 0, its 24 B text
encoder on GPU 1 (`--place diffusion=0 --place ar_encoder=1`, docs/gpu.md), random weights at the
real shapes. Prints the server's start, each GPU's memory in use, and `text_to_image`'s latency at
1024² (after a warm-up request), one request at a time.

    python benchmarks/flux2_dev_placed.py [--steps 50] [--requests 2]

The encoder folder (`demo:realistic-flux2-dev-encoder`, about 46 GB) is built into the cache on its
first use, on a GPU, before the server starts.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from triton_omni.demo_models import resolve_model
from triton_omni_client import OmniClient
from triton_omni_tools.bench.presets import FLUX2_DEV_PLACED
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, TritonServer, free_port
from triton_omni_tools.repository import copy_repositories

PROMPT = "a lighthouse on a cliff at dusk"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--requests", type=int, default=2)
    args = parser.parse_args()
    resolve_model(FLUX2_DEV_PLACED["ar_encoder"]["parameters"]["model"])
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
            options = {"model": "text_to_image", "guidance_scale": args.guidance, "height": 1024, "width": 1024}
            client.generate_image("warm up", num_inference_steps=2, seed=1, **options)
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, check=True).stdout.split()
            print(f"GPU memory in use (MiB): {', '.join(used)}")
            for seed in range(args.requests):
                began = time.perf_counter()
                client.generate_image(PROMPT, num_inference_steps=args.steps, seed=seed, **options)
                print(f"text_to_image 1024², {args.steps} steps, guidance {args.guidance}: "
                      f"{time.perf_counter() - began:.2f} s")


if __name__ == "__main__":
    main()
