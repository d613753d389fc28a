"""Worker processes holding a copy of a diffusion transformer on another
device: what sequence parallel and CFG parallel share.

torch.distributed wants one process per device, so the runner's own process
is rank 0 (it keeps serving, and its transformer is the one every caller
already uses) and every other device gets a worker process. A worker builds
the transformer (every denoiser of a family that has several) from its config
on its device and takes every weight from rank 0 over the collective: no checkpoint is read twice, and in-memory random
weights work too. Rank 0 then sends each call's arguments: small values over a
gloo group (the host's), tensors over the devices' own (NCCL on GPUs).

Why processes rather than threads: each worker issues its own kernels with its
own interpreter, where a thread would share rank 0's GIL with the thread
serving requests (on a host that issues kernels slowly, the second GPU then
waits for the first one's Python).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

# How long rank 0 waits for the workers to join and to take the weights: a 20 B
# transformer is built on each worker's GPU first.
JOIN_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class _Tensor:
    """A tensor argument's place in a call's message; its data follows on the device group."""
    shape: tuple[int, ...]
    dtype: torch.dtype


def start(target: Callable, name: str, networks: Sequence[torch.nn.Module], devices: list[torch.device],
          *extra: Any) -> tuple[list[multiprocessing.Process], int]:
    """One worker process per device in ``devices`` (ranks 1..N), each running
    ``target(rank, world, port, device, specs, *extra)``, where ``specs`` lets ``build`` make each
    of ``networks`` (a family's denoisers: Wan 2.2 A14B has two); returns them and the port rank 0
    joins them on."""
    port = _free_port()
    spawn = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
    specs = [(type(network).__module__, type(network).__name__, dict(network.config), network.dtype)
             for network in networks]
    world = len(devices) + 1
    workers = [spawn.Process(target=target, name=f"{name}-{rank}", daemon=True,
                             args=(rank, world, port, str(device), specs, *extra))
               for rank, device in enumerate(devices, start=1)]
    for worker in workers:
        worker.start()
    return workers, port


def join(rank: int, world: int, port: int, device: torch.device) -> dist.ProcessGroup:
    """Join the group; returns the gloo group for the small messages. On GPUs, CUDA tensors go
    over NCCL and CPU ones over gloo: diffusers' uneven splits exchange their sizes as CPU
    tensors then, without a wait for the GPU."""
    if rank > 0 and device.type == "cuda":
        torch.cuda.set_device(device)  # a worker's own GPU, before NCCL binds to it
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    # Every rank is on this host: gloo on the loopback, not whatever the hostname resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # No device_id: a group bound to its device makes torch's device mesh split it with
    # ncclCommSplit, and that crashes (torch 2.11, NCCL 2.28) the second time a process makes a group,
    # as a test or a reload in one process does. Unbound, NCCL takes each tensor's device.
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=JOIN_TIMEOUT)
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def build(specs: list[tuple[str, str, dict, torch.dtype]], device: torch.device) -> list[torch.nn.Module]:
    """A worker's networks: each built from rank 0's config on the worker's device, then
    ``share_weights`` fills them."""
    networks = []
    for module, name, config, dtype in specs:
        cls = getattr(importlib.import_module(module), name)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                networks.append(cls.from_config(config).eval().requires_grad_(False))
        finally:
            torch.set_default_dtype(default)
    return networks


def share_weights(networks: Sequence[torch.nn.Module]) -> None:
    """Every parameter and buffer from rank 0, network after network, in each state dict's order
    (the same on every rank)."""
    with torch.no_grad():
        for network in networks:
            for tensor in network.state_dict().values():
                dist.broadcast(tensor, src=0)


def send_call(control: dist.ProcessGroup, args: tuple, kwargs: dict, note: Any = None) -> None:
    """On rank 0: one call's arguments (any nesting of tensors and plain values) and a note of
    plain values, to every worker."""
    leaves, spec = pytree.tree_flatten((args, kwargs))  # Z-Image takes lists of tensors
    tensors = [leaf.contiguous() for leaf in leaves if isinstance(leaf, torch.Tensor)]
    message = ([_Tensor(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf
                for leaf in leaves], pytree.treespec_dumps(spec), note)
    dist.broadcast_object_list([message], src=0, group=control)
    for tensor in tensors:
        dist.broadcast(tensor, src=0)


def receive_call(control: dist.ProcessGroup, device: torch.device) -> tuple[tuple, dict, Any] | None:
    """On a worker: the next call's (args, kwargs, note), or None when rank 0 says stop."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    if box[0] is None:
        return None
    leaves, spec, note = box[0]

    def receive(value: Any) -> Any:
        if isinstance(value, _Tensor):
            tensor = torch.empty(value.shape, dtype=value.dtype, device=device)
            dist.broadcast(tensor, src=0)
            return tensor
        return value

    args, kwargs = pytree.tree_unflatten([receive(leaf) for leaf in leaves], pytree.treespec_loads(spec))
    return args, kwargs, note


def check_alive(workers: list[multiprocessing.Process], devices: list[torch.device], what: str) -> None:
    """Before a call: a worker that exited fails it, naming the worker (its peers would wait forever)."""
    for rank, (worker, device) in enumerate(zip(workers, devices, strict=True), start=1):
        if not worker.is_alive():
            raise RuntimeError(f"{what}: the worker of rank {rank} on {device} exited (code {worker.exitcode}); "
                               "reload the model")


def stop(workers: list[multiprocessing.Process], control: dist.ProcessGroup | None) -> None:
    """Tell the workers to stop, wait for them, leave the group. None once one is gone, as the
    others may wait forever in a collective it never joins: they are killed."""
    wait = 0 if any(worker.exitcode is not None for worker in workers) else 30
    if control is not None:
        with contextlib.suppress(Exception):
            dist.broadcast_object_list([None], src=0, group=control)
    for worker in workers:
        worker.join(timeout=wait)
        if worker.is_alive():
            worker.kill()
            worker.join()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()  # so that a later load in this process can start again


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
