"""Stages placed over two GPUs, served by a real tritonserver: instances on
both GPUs serve, an image is the same on either GPU within the determinism
tolerance, the metrics say which GPU did the work, and one vLLM engine runs
tensor parallel over both. Needs two GPUs (``nvidia-h200-x2``; docs/gpu.md)."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, TritonServer, free_port, gpu_count

if gpu_count() < 2:
    pytest.skip("needs two GPUs", allow_module_level=True)

from triton_omni.demo_models import build_all
from triton_omni_client import OmniClient
from triton_omni_tools.repository import copy_model

IMAGE = {"num_inference_steps": 10, "height": 256, "width": 256, "guidance_scale": 5.0}


def metric_value(server: TritonServer, name: str, **labels: str) -> float:
    """Sum of a metric's samples with these labels (tests/support needs tritonclient's HTTP client,
    which the GPU host's venv lacks)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def serve(repositories: list[Path], log: Path, **options) -> TritonServer:
    return TritonServer(ServerOptions(model_repositories=repositories, http_port=free_port(), grpc_port=free_port(),
                                      metrics_port=free_port(), log_file=log, **options))


@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    """``diffusion`` with one instance on each GPU (``--place diffusion=0,1``), and one copy pinned to each GPU."""
    build_all()
    tmp = tmp_path_factory.mktemp("multi-gpu")
    pinned = tmp / "pinned"
    for gpu in (0, 1):
        copy_model(DEFAULT_REPOSITORIES[0], "diffusion", pinned, f"diffusion_gpu{gpu}",
                   instance_group=[{"kind": "KIND_GPU", "count": 1, "gpus": [gpu]}],
                   parameters={"gpu_memory_utilization": "0.1"})
    server = serve([*DEFAULT_REPOSITORIES, pinned], tmp / "server.log", placement=["diffusion=0,1"],
                   model_control_mode="explicit", load_models=["diffusion", "diffusion_gpu0", "diffusion_gpu1"])
    with server:
        yield server


def test_instances_on_both_gpus_serve(spread):
    requests = [dict(IMAGE, prompt=f"prompt {i}", seed=i) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        images = list(pool.map(lambda r: OmniClient(spread.grpc_url).generate_image(**r), requests))
    assert all(image.shape == (256, 256, 3) for image in images)
    steps = {gpu: metric_value(spread, "omni_diffusion_steps_total", model="diffusion", device=gpu)
             for gpu in ("gpu0", "gpu1")}
    assert steps["gpu0"] > 0 and steps["gpu1"] > 0, steps
    assert steps["gpu0"] + steps["gpu1"] == 16 * IMAGE["num_inference_steps"]
    # spread by load (triton/balance.py): 8 and 8, give or take the requests that finished early
    assert abs(steps["gpu0"] - steps["gpu1"]) <= 4 * IMAGE["num_inference_steps"], steps


def test_an_image_is_the_same_on_either_gpu(spread):
    client = OmniClient(spread.grpc_url)
    for seed in (1, 2, 3):
        on = [client.generate_image("a lighthouse at dusk", model=f"diffusion_gpu{gpu}", seed=seed, **IMAGE)
              for gpu in (0, 1)]
        difference = np.abs(on[0].astype(int) - on[1].astype(int)).max()
        assert difference <= 1, f"seed {seed}: images differ by {difference} between the GPUs"
    assert metric_value(spread, "omni_diffusion_steps_total", model="diffusion_gpu1", device="gpu1") > 0
    # each instance keeps its own graph cache on its own GPU: one request at a time holds its
    # shape for 10 steps, so each pinned model captured a graph
    for gpu in (0, 1):
        assert metric_value(spread, "omni_diffusion_graph_captures_total", model=f"diffusion_gpu{gpu}",
                            device=f"gpu{gpu}") > 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_one_vllm_engine_over_both_gpus():
    build_all()
    with tempfile.TemporaryDirectory() as tmp:
        server = serve(list(DEFAULT_REPOSITORIES), Path(tmp) / "server.log", placement=["ar=tp:0,1"],
                       model_control_mode="explicit", load_models=["ar"])
        with server:
            chunks = list(OmniClient(server.grpc_url).generate_text(
                "a lighthouse", stream=True, max_tokens=32, sampling_parameters={"ignore_eos": True}))
            assert len(chunks) > 1
            assert metric_value(server, "omni_ar_generated_tokens_total", model="ar", device="gpu0+gpu1") == 32
            log = (Path(tmp) / "server.log").read_text()
            assert "tensor_parallel_size=2" in log or "world_size=2" in log, "vLLM did not run tensor parallel"
