"""The GPU memory plan: each model's share of its GPU, checked before it loads.

Every stage that runs on a GPU has a model parameter
``gpu_memory_utilization``, the fraction of the GPU's total memory it may
use (vLLM's name and meaning). vLLM engines take it as their budget (weights,
activations, CUDA graphs and KV cache); torch runners (diffusion, the
transformers AR engine) cap their caching allocator at it, so a stage that
outgrows its share fails alone with an out-of-memory error instead of
starving the others.

``check_share`` runs before a model loads: when less memory is free than the
share asks for, the load fails at once with the numbers, rather than in the
middle of vLLM's start-up or with a CUDA OOM later. The launcher checks the
whole plan (the sum over the models on each GPU) before the server starts
(``triton_omni_tools.memory_plan``).

The free memory is read with ``nvidia-smi``, so that the check creates no
CUDA context in this process: vLLM must be able to start its engine core
from a process that has not touched CUDA.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

GIB = 1024**3


class MemoryPlanError(RuntimeError):
    """The model's share of GPU memory is not free; raised at load time."""


@dataclass(frozen=True)
class GpuMemory:
    index: int  # physical index, as nvidia-smi numbers GPUs
    total: int  # bytes
    free: int


def physical_index(device: str) -> int:
    """``cuda:N`` (N among the visible devices) to nvidia-smi's numbering."""
    return visible_to_physical(int(device.split(":")[1]) if ":" in device else 0)


def parse_gpus(raw: str) -> list[int]:
    """The ``gpus`` model parameter, ``"0,1"``, as ``[0, 1]``; anything else refused by name."""
    try:
        gpus = [int(part) for part in raw.split(",")]
    except ValueError:
        gpus = []
    if not gpus or min(gpus) < 0 or len(set(gpus)) != len(gpus):
        raise ValueError(f"model parameter 'gpus' must list distinct GPU indexes, e.g. \"0,1\"; got {raw!r}")
    return gpus


def visible_to_physical(ordinal: int) -> int:
    """A GPU ordinal among this process's visible GPUs, in nvidia-smi's numbering."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and all(v.isdigit() for v in visible):
        if ordinal >= len(visible):
            raise MemoryPlanError(f"GPU {ordinal} is not among the {len(visible)} visible ones "
                                  f"(CUDA_VISIBLE_DEVICES={','.join(visible)})")
        return int(visible[ordinal])
    return ordinal


def query(index: int) -> GpuMemory | None:
    """Total and free memory of one GPU; None where nvidia-smi is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        line = subprocess.run(
            ["nvidia-smi", f"--id={index}", "--query-gpu=memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
            env=os.environ.copy()).stdout.strip()  # a private copy: other threads may set variables meanwhile
        total_mib, free_mib = (int(v) for v in line.split(","))
    except (subprocess.SubprocessError, ValueError, OSError):
        return None
    return GpuMemory(index, total_mib * 1024**2, free_mib * 1024**2)


def check_share(model: str, share: float, gpus: tuple[int, ...]) -> None:
    """Raise ``MemoryPlanError`` when ``share`` of each of ``gpus`` (physical
    indexes; none on the CPU) is not free now."""
    if not 0.0 < share <= 1.0:
        raise MemoryPlanError(f"model '{model}': gpu_memory_utilization must be in (0, 1], got {share}")
    for index in gpus:
        gpu = query(index)
        if gpu is None:
            continue
        wanted = share * gpu.total
        if gpu.free < wanted:
            raise MemoryPlanError(
                f"model '{model}': the memory plan does not fit GPU {gpu.index}: gpu_memory_utilization {share:g} "
                f"asks for {wanted / GIB:.1f} GiB of its {gpu.total / GIB:.1f} GiB, but only "
                f"{gpu.free / GIB:.1f} GiB is free ({(gpu.total - gpu.free) / GIB:.1f} GiB is held by the models "
                f"loaded before it and other processes). Lower this model's gpu_memory_utilization parameter, or "
                f"the others' on GPU {gpu.index}; their sum must stay below 1 (docs/operations.md, "
                f"'GPU memory plan').")


def cap_torch(share: float, device: str) -> None:
    """Cap this process's torch allocator on ``device`` at ``share`` of the GPU."""
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index
        torch.cuda.set_per_process_memory_fraction(share, torch.cuda.current_device() if index is None else index)
