"""One rule for the ``dtype`` model parameter of every stage."""

from __future__ import annotations

import torch


def torch_dtype(name: str, device: str, cuda_default: torch.dtype) -> torch.dtype:
    """``auto``: ``cuda_default`` on CUDA (each stage's fastest exact type),
    float32 on the CPU; otherwise the torch dtype of that name."""
    if name == "auto":
        return cuda_default if device.startswith("cuda") else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model parameter 'dtype' must be 'auto' or a torch dtype name, got {name!r}")
    return dtype
