"""On a GPU: a launcher killed with SIGKILL (the OOM killer, ``timeout -s KILL``) or SIGTERM (``timeout``,
a cancelled CI job) with its server running leaves no process of the server's group and no GPU memory:
the ``diffusion`` stub's CUDA context and allocator and vLLM's engine core with its KV cache included.
Before the reaper (reaper.py), such a server went on running as an orphan, holding its GPU memory."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from triton_omni.demo_models import build_all
from triton_omni_client import OmniClient
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, gpu_count
from triton_omni_tools.reaper import process_group
from triton_omni_tools.repository import copy_model

from tests.support.launched import launched

if gpu_count() < 1:
    pytest.skip("needs a GPU", allow_module_level=True)


def gpu_memory_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip())


def gpu_pids() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return {int(line) for line in out.split()}


@pytest.mark.parametrize("end", ["SIGKILL"])  # SIGTERM and an exception: tests/reliability, on the CPU
def test_a_killed_launcher_leaves_no_process_and_no_gpu_memory(tmp_path, end):
    build_all()
    repository = tmp_path / "repository"
    copy_model(DEFAULT_REPOSITORIES[0], "diffusion", repository,
               instance_group=[{"kind": "KIND_GPU", "count": 1, "gpus": [0]}])
    copy_model(DEFAULT_REPOSITORIES[0], "ar", repository)
    baseline = gpu_memory_used_mib()
    with launched("server", repository, tmp_path / "tritonserver.log", end) as (parent, started):
        check_no_gpu_memory_left(parent, started, end, baseline)


def check_no_gpu_memory_left(parent, started: dict, end: str, baseline: int) -> None:
    pgid = started["pgid"]
    group = set(process_group(pgid))
    image = OmniClient(started["grpc"]).generate_image("a red fox", seed=1, num_inference_steps=4, height=64,
                                                       width=64)
    assert image.shape == (64, 64, 3)
    holding = gpu_pids() & {*group, *process_group(pgid)}
    assert len(holding) >= 2, f"expected the diffusion stub and vLLM's engine core on the GPU: {holding}"
    used = gpu_memory_used_mib()
    assert used > baseline, (baseline, used)

    parent.send_signal(getattr(signal, end))
    assert parent.wait(60) != 0
    deadline = time.monotonic() + 60
    while (process_group(pgid) or gpu_pids() & holding or gpu_memory_used_mib() > baseline) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not process_group(pgid), "processes of the server's group left"
    assert not gpu_pids() & holding, "processes still on the GPU"
    assert gpu_memory_used_mib() <= baseline, f"GPU memory left: {gpu_memory_used_mib() - baseline} MiB"
    print(f"{end}: {used - baseline} MiB held by the server, {gpu_memory_used_mib() - baseline} MiB left")
