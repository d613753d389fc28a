"""Sequence parallel: one diffusion transformer's forward over several GPUs.

diffusers' context parallelism (Ulysses) does the parallel part: its hooks
split the image and text tokens across the ranks at the first block, the
attention exchanges heads for tokens with an all-to-all so that each rank
attends over the whole sequence for its share of the heads, and the output is
gathered again after the last projection. It is SPMD, one process per device,
as torch.distributed wants, so:

- the runner's own process is rank 0: it keeps serving and its transformer is
  the one every caller already uses (the pipeline, the step engine);
- every other device gets a worker process (ranks 1..N-1) holding a copy of
  the transformer, whose weights it receives from rank 0 over the collective
  (no checkpoint is read twice, and in-memory random weights work too);
- each forward of the transformer on rank 0 first broadcasts its arguments (a
  forward pre-hook), so the workers run the same forward in step. Small values
  go over a gloo group, tensors over the device's own (NCCL on GPUs).

The workers serve no requests of their own: a worker that dies fails rank 0's
next forward with an error that names it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

logger = logging.getLogger(__name__)

# How long rank 0 waits for the workers to join and to take the weights: a 20 B
# transformer is built on each worker's GPU first.
JOIN_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class _Tensor:
    """A tensor argument's place in the broadcast message; its data follows on the device group."""
    shape: tuple[int, ...]
    dtype: torch.dtype


def _z_image_plan(transformer: Any) -> dict:
    """Z-Image's main layers run one joint sequence (image and prompt tokens, each padded to a
    multiple of 32): split it and its rotary frequencies at every layer, gather after the final
    layer. The refiners before run whole on every rank; they are a small share of the work.
    diffusers (0.42) ships no plan for Z-Image."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        "layers.0": {"x": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
        "layers.*": {"freqs_cis": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
    } | {f"all_final_layer.{patch}": ContextParallelOutput(gather_dim=1, expected_dims=3)
         for patch in transformer.all_final_layer}  # one final layer per patch size


# transformers whose plan is ours, and the multiple their split sequence is padded to
PLANS = {"ZImageTransformer2DModel": (_z_image_plan, 32)}


def supports(transformer: Any) -> bool:
    """Whether this transformer's sequence can be split: diffusers' context-parallel plan, or ours."""
    return getattr(transformer, "_cp_plan", None) is not None or type(transformer).__name__ in PLANS


def _plan(transformer: Any) -> dict:
    ours = PLANS.get(type(transformer).__name__)
    return ours[0](transformer) if ours else transformer._cp_plan


class SequenceParallel:
    """``transformer`` (on rank 0's device) run over it and ``devices``, one worker process each."""

    def __init__(self, transformer: torch.nn.Module, devices: list[torch.device]):
        if not supports(transformer):
            raise ValueError(f"sequence parallel: no context-parallel plan for {type(transformer).__name__}")
        device = transformer.device
        self.devices = [device, *devices]
        world = len(self.devices)
        _check_ranks(transformer, world, device)
        port = _free_port()
        spawn = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
        cls = type(transformer)
        self.workers = [spawn.Process(target=_serve, name=f"omni-sequence-parallel-{rank}", daemon=True,
                                      args=(rank, world, port, str(self.devices[rank]), cls.__module__,
                                            cls.__name__, dict(transformer.config), transformer.dtype))
                        for rank in range(1, world)]
        for worker in self.workers:
            worker.start()
        try:
            self.control = _join(0, world, port, device)
            _share_weights(transformer)
            _enable(transformer, world, device)
            self._split = _Split(transformer, world)
        except Exception:
            self._stop_workers(self._grace())
            if dist.is_initialized():
                dist.destroy_process_group()  # so that a later load in this process can start again
            raise
        self._hook = transformer.register_forward_pre_hook(self._send, with_kwargs=True)
        self.transformer = transformer

    def _send(self, module, args: tuple, kwargs: dict) -> None:
        """Before each forward on rank 0: the same arguments to every worker."""
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                raise RuntimeError(f"sequence parallel: the worker of rank {rank} on {self.devices[rank]} exited "
                                   f"(code {worker.exitcode}); reload the model")
        leaves, spec = pytree.tree_flatten((args, kwargs))  # Z-Image takes lists of tensors
        tensors = [leaf.contiguous() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        message = ([_Tensor(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf
                    for leaf in leaves], pytree.treespec_dumps(spec))
        dist.broadcast_object_list([message], src=0, group=self.control)
        for tensor in tensors:
            dist.broadcast(tensor, src=0)
        self._split.choose(kwargs)

    def close(self) -> None:
        """Tell the workers to stop, wait for them, leave the group."""
        self._hook.remove()
        wait = self._grace()
        with contextlib.suppress(Exception):
            dist.broadcast_object_list([None], src=0, group=self.control)
        self._stop_workers(wait)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _grace(self) -> float:
        """How long the workers get to leave: none once one is gone, as the others may wait
        forever in a collective it never joins."""
        return 0 if any(worker.exitcode is not None for worker in self.workers) else 30

    def _stop_workers(self, wait: float) -> None:
        for worker in self.workers:
            worker.join(timeout=wait)
            if worker.is_alive():
                worker.kill()
                worker.join()


def _serve(rank: int, world: int, port: int, device: str, module: str, name: str, config: dict,
           dtype: torch.dtype) -> None:
    """A worker process: build the transformer, take rank 0's weights, then run every forward rank 0 runs."""
    logging.basicConfig(level=logging.INFO, format=f"sequence parallel rank {rank}: %(message)s")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    control = _join(rank, world, port, device)
    cls = getattr(importlib.import_module(module), name)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        transformer = cls.from_config(config).eval().requires_grad_(False)
    torch.set_default_dtype(default)
    _share_weights(transformer)
    _enable(transformer, world, device)
    split = _Split(transformer, world)
    logger.info("%s ready on %s", name, device)
    with torch.inference_mode():
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            if box[0] is None:
                break
            leaves, spec = box[0]

            def receive(value: Any) -> Any:
                if isinstance(value, _Tensor):
                    tensor = torch.empty(value.shape, dtype=value.dtype, device=device)
                    dist.broadcast(tensor, src=0)
                    return tensor
                return value

            args, kwargs = pytree.tree_unflatten([receive(leaf) for leaf in leaves], pytree.treespec_loads(spec))
            split.choose(kwargs)
            transformer(*args, **kwargs)
    dist.destroy_process_group()


def _heads(transformer: Any) -> int:
    config = transformer.config
    return config.get("num_attention_heads") or config.get("n_heads")


def _check_ranks(transformer: Any, world: int, device: torch.device) -> None:
    """Refuse, at load, rank counts the attention cannot split: each rank takes at least one head,
    and on the CPU (gloo gathers equal shares only) a padded sequence must share evenly."""
    if _heads(transformer) < world:
        raise ValueError(f"sequence parallel over {world} devices: {type(transformer).__name__} has "
                         f"{_heads(transformer)} attention heads, and each device takes at least one")
    ours = PLANS.get(type(transformer).__name__)
    if device.type == "cpu" and ours and ours[1] % world:
        raise ValueError(f"sequence parallel on the CPU: {type(transformer).__name__}'s sequence, padded to a "
                         f"multiple of {ours[1]}, does not share evenly over {world} processes")


def _join(rank: int, world: int, port: int, device: torch.device) -> dist.ProcessGroup:
    """Join the group; returns the gloo group for the small messages. On GPUs, CUDA tensors go
    over NCCL and CPU ones over gloo: diffusers' uneven splits exchange their sizes as CPU
    tensors then, without a wait for the GPU."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    # Every rank is on this host: gloo on the loopback, not whatever the hostname resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=JOIN_TIMEOUT, device_id=device if device.type == "cuda" else None)
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


class _Split:
    """Per forward, even shares when every split sequence and the heads divide by the ranks, else
    diffusers' "anything" mode, which exchanges each share's size before every all-to-all. Every
    rank sees the same arguments, so every rank chooses the same."""

    def __init__(self, transformer: torch.nn.Module, world: int):
        self.world = world
        self.config = transformer._parallel_config.context_parallel_config
        ours = PLANS.get(type(transformer).__name__)
        # the forward's own arguments that are split, and along which dim (none: the split
        # sequence is built inside the forward, padded to a multiple)
        self.arguments = {} if ours else {
            name: entry.split_dim for plan in transformer._cp_plan.values() if isinstance(plan, dict)
            for name, entry in plan.items() if isinstance(name, str) and hasattr(entry, "split_dim")}
        self.always_even = _heads(transformer) % world == 0 and (ours is None or ours[1] % world == 0)

    def choose(self, kwargs: dict) -> None:
        even = self.always_even and all(
            value.shape[dim] % self.world == 0 for name, dim in self.arguments.items()
            if isinstance(value := kwargs.get(name), torch.Tensor) and value.dim() > dim)
        self.config.ulysses_anything = not even


def _share_weights(transformer: torch.nn.Module) -> None:
    """Every parameter and buffer from rank 0, in the state dict's order (the same on every rank)."""
    with torch.no_grad():
        for tensor in transformer.state_dict().values():
            dist.broadcast(tensor, src=0)


def _enable(transformer: torch.nn.Module, world: int, device: torch.device) -> None:
    """diffusers' Ulysses attention over all ranks. "Anything" mode takes any token count and head
    count, so requests need no padding: a prompt's token count is rarely a multiple of the ranks."""
    from diffusers.models._modeling_parallel import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("ring", "ulysses"))
    config = ContextParallelConfig(ulysses_degree=world, ulysses_anything=True, mesh=mesh)
    with _accelerator_count_on_cpu(device):
        transformer.enable_parallelism(config=config, cp_plan=_plan(transformer))


@contextlib.contextmanager
def _accelerator_count_on_cpu(device: torch.device):
    """diffusers (0.42) names a device as ``rank % torch.accelerator.device_count()``, which divides
    by zero on a host without an accelerator. Context parallelism never uses that device (the mesh
    is ours), so on the CPU the count reads 1 for the call."""
    if device.type != "cpu" or torch.accelerator.device_count() > 0:
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
