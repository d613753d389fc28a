"""What the benchmarks say about the GPU they ran on: its name, its dense bf16 peak for MFU, and
the least time a DiT's work can take on it (imported by the scripts beside it, which Python runs
with this folder on its path)."""

from __future__ import annotations

import platform

# dense bf16 tensor-core peaks (FLOP/s, no sparsity) by the device name's model, from NVIDIA's data sheets;
# the first name found in the device's wins (so "H100 PCIe" before "H100")
PEAK_BF16 = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "B200": 2250e12,
             "A100": 312e12, "L40S": 362e12}
# dense FP8 (E4M3) tensor-core peaks: twice bf16's where the GPU has FP8 at all (not the A100)
PEAK_FP8 = {model: 2 * peak for model, peak in PEAK_BF16.items() if model != "A100"}


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"


def peak_bf16(device: str) -> float | None:
    """The dense bf16 peak of the GPU named ``device``; None for one not in the table (or a CPU)."""
    return next((peak for model, peak in PEAK_BF16.items() if model in device), None)


def peak_fp8(device: str) -> float | None:
    return next((peak for model, peak in PEAK_FP8.items() if model in device), None)


def limit_seconds(linear_flops: float, attention_flops: float, device: str, fp8: bool) -> float | None:
    """The least time this work can take on ``device``: the linear layers at the dense peak of the
    type they run in (FP8's with ``fp8``), attention at bf16's (its kernels here run in bf16). None
    for a GPU not in the tables (or a CPU)."""
    bf16, linear_peak = peak_bf16(device), peak_fp8(device) if fp8 else peak_bf16(device)
    if bf16 is None or linear_peak is None:
        return None
    return linear_flops / linear_peak + attention_flops / bf16
