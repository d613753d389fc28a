"""Host tensors onto a GPU without waiting for it: the one copy rule every stage uses, and
``queued``, which holds code written for any device (a diffusers scheduler's step) to it."""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` on ``device`` (in ``dtype``); from the CPU to a GPU through pinned memory, without
    waiting: a copy from pageable memory may first wait for everything queued on the stream (CUDA
    documents it), and PyTorch's pinned-memory cache keeps the block until the copy is done."""
    if dtype is not None:
        tensor = tensor.to(dtype=dtype)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class _Queued(TorchFunctionMode):
    """See ``queued``. Inside ``__torch_function__`` the mode is off, so its own calls pass through.
    Calls it cannot reroute with the same result it leaves as they are: ``solve`` with ``out``,
    ``.to`` with ``copy``, a memory format or ``non_blocking``, and a host tensor already pinned
    (the copy would read memory its owner may change) or whose elements overlap (pinning copies
    its strides)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.linalg.solve and "out" not in kwargs:
            return torch.linalg.solve_ex(*args, **kwargs, check_errors=False).result
        if func is torch.Tensor.to and _reroutable(args[0]):
            try:  # torch's own parser, which refuses `copy` (keyword or positional)
                device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            except RuntimeError:
                return func(*args, **kwargs)
            if device is not None and device.type == "cuda" and not non_blocking and memory_format is None:
                return to_device(args[0], device, dtype)
        return func(*args, **kwargs)


def _reroutable(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and 0 not in tensor.stride() and not tensor.is_pinned()


def queued(device: torch.device) -> contextlib.AbstractContextManager:
    """Meanwhile, on a GPU ``device``, this thread's host tensors copied onto a GPU go through
    ``to_device`` (pinned memory, no wait), and ``torch.linalg.solve`` skips the check that reads
    its status back (``solve_ex``: the same solution, op for op; a singular system gives infinities
    rather than an error). Diffusers' UniPC (Wan's scheduler) keeps its sigmas on the host and
    solves its corrector's coefficients on the device: each of its steps waited for the forward
    pass queued before it, and the GPU idled while the host queued the next one. On a CPU: nothing
    changes. The mode is this thread's alone."""
    return _Queued() if device.type == "cuda" else contextlib.nullcontext()
