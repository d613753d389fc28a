"""Host tensors onto a GPU without waiting for it: the one copy rule every stage uses."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` on ``device`` (in ``dtype``); from the CPU to a GPU through pinned memory, without
    waiting: a copy from pageable memory may first wait for everything queued on the stream (CUDA
    documents it), and PyTorch's pinned-memory cache keeps the block until the copy is done."""
    if dtype is not None:
        tensor = tensor.to(dtype=dtype)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
