"""FLUX.2 [dev] at full size on two GPUs: its 32 B DiT (about 64 GB in bf16) and its 24 B text encoder
(Mistral-Small-3.1's language model, about 46 GB) do not fit one 80 GB GPU together, so `ar_encoder`
runs on the second (`--place ar_encoder=1 --place diffusion=0`, docs/gpu.md). Random weights at the
real shapes. The memory plan refuses both on one GPU before anything loads; placed apart,
`text_to_image` serves a 1024² image end to end, and it is the image `diffusion` gives for
`ar_encoder`'s own embeddings. Two GPUs only (docs/gpu.md)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

from triton_omni.demo_models import resolve_model
from triton_omni_client import OmniClient
from triton_omni_tools.bench.presets import FLUX2_DEV_PLACED
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, TritonServer, free_port
from triton_omni_tools.memory_plan import MemoryPlanError
from triton_omni_tools.repository import copy_repositories

ENCODER = FLUX2_DEV_PLACED["ar_encoder"]["parameters"]["model"]
REQUEST = {"num_inference_steps": 4, "guidance_scale": 4.0, "height": 1024, "width": 1024, "seed": 3}


def options(repositories: list[Path], placement: list[str], log: Path) -> ServerOptions:
    return ServerOptions(model_repositories=repositories, http_port=free_port(), grpc_port=free_port(),
                         metrics_port=free_port(), model_control_mode="explicit", placement=placement,
                         load_models=["ar_encoder", "diffusion", "text_to_image"], log_file=log)


def gpu_memory_used() -> list[int]:
    """MiB in use on each GPU, as nvidia-smi reports it."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [int(line) for line in out.split()]


def test_flux2_dev_serves_with_its_encoder_on_the_other_gpu():
    # the encoder folder is built once, on the GPU, before the server's processes need that memory
    resolve_model(ENCODER)
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        repositories = copy_repositories(DEFAULT_REPOSITORIES, Path(tmp) / "repos", FLUX2_DEV_PLACED)
        together = TritonServer(options(repositories, ["ar_encoder=0", "diffusion=0"], Path(tmp) / "refused.log"))
        with pytest.raises(MemoryPlanError, match="GPU 0"):  # 0.93 + 0.70 of one GPU, refused before loading
            together.check_memory_plan()
        shutil.rmtree(together.run_dir, ignore_errors=True)
        with TritonServer(options(repositories, ["ar_encoder=1", "diffusion=0"], Path(tmp) / "server.log")) as server:
            client = OmniClient(server.grpc_url)
            image = client.generate_image("a lighthouse on a cliff at dusk", model="text_to_image", **REQUEST)
            used = gpu_memory_used()
            print(f"FLUX.2 [dev] placed: GPU memory in use (MiB) {used}")
            conditioning = client.encode_conditioning("a lighthouse on a cliff at dusk")
            assert conditioning["prompt_embeds"].shape == (512, 3 * 5120)
            del conditioning["negative_prompt_embeds"]  # guidance-distilled: no negative pass
            again = client.generate_image(**conditioning, **REQUEST)
    assert image.shape == (1024, 1024, 3)
    assert int(np.abs(image.astype(int) - again.astype(int)).max()) <= 1
    assert used[0] > 60_000 and used[1] > 40_000, used  # the DiT on GPU 0, the encoder on GPU 1
