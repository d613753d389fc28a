"""Sequence parallel: one diffusion transformer's forward over several GPUs.

diffusers' context parallelism (Ulysses) does the parallel part: its hooks
split the image and text tokens across the ranks at the first block, the
attention exchanges heads for tokens with an all-to-all so that each rank
attends over the whole sequence for its share of the heads, and the output is
gathered again after the last projection. It is SPMD, one process per
device (workers.py): rank 0 is the runner's own process, every other device
a worker with a copy of the transformer, and each forward of the transformer
on rank 0 first sends its arguments (a forward pre-hook), so that the
workers run the same forward in step. A family with several denoisers (Wan
2.2 A14B's two experts) has each split so, the workers holding all of them
and told which one each forward runs.

The workers serve no requests of their own: a worker that dies fails rank 0's
next forward with an error that names it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from triton_omni.diffusion import workers
from triton_omni.families import sequence_parallel_plan

logger = logging.getLogger(__name__)


def supports(transformer: Any) -> bool:
    """Whether this transformer's sequence can be split: diffusers' context-parallel plan, or its family's."""
    return getattr(transformer, "_cp_plan", None) is not None or sequence_parallel_plan(transformer) is not None


def _plan(transformer: Any) -> dict:
    ours = sequence_parallel_plan(transformer)
    return ours[0] if ours else transformer._cp_plan


class SequenceParallel:
    """``networks`` (a family's denoisers, on rank 0's device) each run over it and ``devices``,
    one worker process each holding a copy of every one of them."""

    def __init__(self, networks: tuple[torch.nn.Module, ...], devices: list[torch.device]):
        for network in networks:
            if not supports(network):
                raise ValueError(f"sequence parallel: no context-parallel plan for {type(network).__name__}")
        device = networks[0].device
        self.devices = [device, *devices]
        for network in networks:
            _check_ranks(network, len(self.devices), device)
        self.workers, port = workers.start(_serve, "omni-sequence-parallel", networks, devices)
        self.control = None
        try:
            self.control = workers.join(0, len(self.devices), port, device)
            workers.share_weights(networks)
            self._splits = _enable(networks, len(self.devices), device)
        except Exception:
            workers.stop(self.workers, self.control)
            raise
        self._hooks = [network.register_forward_pre_hook(functools.partial(self._send, index), with_kwargs=True)
                       for index, network in enumerate(networks)]

    def _send(self, index: int, module, args: tuple, kwargs: dict) -> None:
        """Before each forward of network ``index`` on rank 0: the same arguments to every worker."""
        workers.check_alive(self.workers, self.devices[1:], "sequence parallel")
        workers.send_call(self.control, args, kwargs, index)
        self._splits[index].choose(kwargs)

    def close(self) -> None:
        """Tell the workers to stop, wait for them, leave the group."""
        for hook in self._hooks:
            hook.remove()
        workers.stop(self.workers, self.control)


def _serve(rank: int, world: int, port: int, device: str, specs: list) -> None:
    """A worker process: build the networks, take rank 0's weights, then run every forward rank 0 runs."""
    logging.basicConfig(level=logging.INFO, format=f"sequence parallel rank {rank}: %(message)s")
    device = torch.device(device)
    control = workers.join(rank, world, port, device)
    networks = workers.build(specs, device)
    workers.share_weights(networks)
    splits = _enable(networks, world, device)
    logger.info("%s ready on %s", ", ".join(type(network).__name__ for network in networks), device)
    with torch.inference_mode():
        while (call := workers.receive_call(control, device)) is not None:
            args, kwargs, index = call
            splits[index].choose(kwargs)
            networks[index](*args, **kwargs)
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
    ours = sequence_parallel_plan(transformer)
    if device.type == "cpu" and ours and ours[1] % world:
        raise ValueError(f"sequence parallel on the CPU: {type(transformer).__name__}'s sequence, padded to a "
                         f"multiple of {ours[1]}, does not share evenly over {world} processes")


class _Split:
    """Per forward, even shares when every split sequence and the heads divide by the ranks, else
    diffusers' "anything" mode, which exchanges each share's size before every all-to-all. Every
    rank sees the same arguments, so every rank chooses the same."""

    def __init__(self, transformer: torch.nn.Module, world: int):
        from diffusers.models._modeling_parallel import ContextParallelInput

        self.world = world
        self.config = transformer._parallel_config.context_parallel_config
        ours = sequence_parallel_plan(transformer)
        # the forward's own arguments that are split, and along which dim (none: the split
        # sequence is built inside the forward, padded to a multiple)
        self.arguments = {} if ours else {
            name: entry.split_dim for plan in transformer._cp_plan.values() if isinstance(plan, dict)
            for name, entry in plan.items() if isinstance(name, str) and isinstance(entry, ContextParallelInput)}
        patch = transformer.config.get("patch_size")  # a video DiT's (frames, height, width) patch
        self.patch = math.prod(patch) if isinstance(patch, (tuple, list)) else 1
        self.always_even = _heads(transformer) % world == 0 and (ours is None or ours[1] % world == 0)

    def choose(self, kwargs: dict) -> None:
        even = self.always_even and all(
            self._length(value, dim) % self.world == 0 for name, dim in self.arguments.items()
            if isinstance(value := kwargs.get(name), torch.Tensor) and value.dim() > dim)
        self.config.ulysses_anything = not even

    def _length(self, value: torch.Tensor, dim: int) -> int:
        """The split sequence's length: a video DiT's latents ``[N, C, F, H, W]`` are split as the
        tokens its patch embedding makes of them (Wan's plan splits its first block's input)."""
        if value.dim() == 5:
            return value.shape[2:].numel() // self.patch
        return value.shape[dim]


def _enable(networks, world: int, device: torch.device) -> list[_Split]:
    """diffusers' Ulysses attention over all ranks, for each network (one mesh for all); each
    network's ``_Split``. "Anything" mode takes any token count and head count, so requests need no
    padding: a prompt's token count is rarely a multiple of the ranks."""
    from diffusers.models._modeling_parallel import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("ring", "ulysses"))
    for network in networks:
        config = ContextParallelConfig(ulysses_degree=world, ulysses_anything=True, mesh=mesh)
        with _accelerator_count_on_cpu(device):
            network.enable_parallelism(config=config, cp_plan=_plan(network))
    return [_Split(network, world) for network in networks]


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
