"""Sequence parallel: one diffusion transformer's forward over several GPUs.

diffusers' context parallelism (Ulysses) does the parallel part: its hooks
split the image and text tokens across the ranks at the first block, the
attention exchanges heads for tokens with an all-to-all so that each rank
attends over the whole sequence for its share of the heads, and the output is
gathered again after the last projection. It is SPMD, one process per
device (workers.py): rank 0 is the runner's own process, every other device
a worker with a copy of the transformer, and each forward of the transformer
on rank 0 first sends its arguments (a forward pre-hook), so that the
workers run the same forward in step.

The workers serve no requests of their own: a worker that dies fails rank 0's
next forward with an error that names it.
"""

from __future__ import annotations

import contextlib
import logging
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
    """``transformer`` (on rank 0's device) run over it and ``devices``, one worker process each."""

    def __init__(self, transformer: torch.nn.Module, devices: list[torch.device]):
        if not supports(transformer):
            raise ValueError(f"sequence parallel: no context-parallel plan for {type(transformer).__name__}")
        device = transformer.device
        self.devices = [device, *devices]
        _check_ranks(transformer, len(self.devices), device)
        self.workers, port = workers.start(_serve, "omni-sequence-parallel", transformer, devices)
        self.control = None
        try:
            self.control = workers.join(0, len(self.devices), port, device)
            workers.share_weights(transformer)
            _enable(transformer, len(self.devices), device)
            self._split = _Split(transformer, len(self.devices))
        except Exception:
            workers.stop(self.workers, self.control)
            raise
        self._hook = transformer.register_forward_pre_hook(self._send, with_kwargs=True)
        self.transformer = transformer

    def _send(self, module, args: tuple, kwargs: dict) -> None:
        """Before each forward on rank 0: the same arguments to every worker."""
        workers.check_alive(self.workers, self.devices[1:], "sequence parallel")
        workers.send_call(self.control, args, kwargs)
        self._split.choose(kwargs)

    def close(self) -> None:
        """Tell the workers to stop, wait for them, leave the group."""
        self._hook.remove()
        workers.stop(self.workers, self.control)


def _serve(rank: int, world: int, port: int, device: str, module: str, name: str, config: dict,
           dtype: torch.dtype) -> None:
    """A worker process: build the transformer, take rank 0's weights, then run every forward rank 0 runs."""
    logging.basicConfig(level=logging.INFO, format=f"sequence parallel rank {rank}: %(message)s")
    device = torch.device(device)
    control = workers.join(rank, world, port, device)
    transformer = workers.build(module, name, config, dtype, device)
    workers.share_weights(transformer)
    _enable(transformer, world, device)
    split = _Split(transformer, world)
    logger.info("%s ready on %s", name, device)
    with torch.inference_mode():
        while (call := workers.receive_call(control, device)) is not None:
            args, kwargs, _ = call
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
        self.always_even = _heads(transformer) % world == 0 and (ours is None or ours[1] % world == 0)

    def choose(self, kwargs: dict) -> None:
        even = self.always_even and all(
            value.shape[dim] % self.world == 0 for name, dim in self.arguments.items()
            if isinstance(value := kwargs.get(name), torch.Tensor) and value.dim() > dim)
        self.config.ulysses_anything = not even


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
