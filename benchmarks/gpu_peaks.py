"""What the benchmarks say about the GPU they ran on: its name, and its dense bf16 peak for MFU
(imported by the scripts beside it, which Python runs with this folder on its path)."""

from __future__ import annotations

import platform

# dense bf16 tensor-core peaks (FLOP/s, no sparsity) by the device name's model, from NVIDIA's data sheets;
# the first name found in the device's wins (so "H100 PCIe" before "H100")
PEAK_BF16 = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "B200": 2250e12,
             "A100": 312e12, "L40S": 362e12}


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"


def peak_bf16(device: str) -> float | None:
    """The dense bf16 peak of the GPU named ``device``; None for one not in the table (or a CPU)."""
    return next((peak for model, peak in PEAK_BF16.items() if model in device), None)
