"""CFG parallel: a DiT's negative prompts' passes on a second device, in a
worker process of its own (workers.py), while rank 0 runs the prompts' passes.

True CFG (Qwen-Image) runs two passes of the transformer per step, one over the
prompts and one over the negatives, with their own text lengths. Per step rank 0
sends the negatives' arguments, issues its own pass, then receives the
negatives' output: the same kernels on the same rows as on one device, so the
image is the one device's, bit for bit.

The step cache (step_cache.py) keeps its state per request's pass. The
negatives' states live in the worker, keyed by a number rank 0 gives each
request's negative pass; rank 0 says which ones ended with its next call, and
the worker answers each cached pass's decision (whether it computed every
block), which rank 0 needs to count skipped steps.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist

from triton_omni.diffusion import workers
from triton_omni.diffusion.kernels import NetworkKernels

logger = logging.getLogger(__name__)


class CfgParallel:
    """The negatives' passes of ``networks`` (a family's denoisers: Wan 2.2 A14B has two experts)
    on ``device``, in a worker process that holds a copy of each."""

    def __init__(self, networks: tuple[torch.nn.Module, ...], device: torch.device,
                 compile_options: dict | None = None,
                 kernels: NetworkKernels | None = None, graphs: bool = False):
        """``compile_options``, ``kernels`` and ``graphs`` (its forward replayed as CUDA graphs):
        what the worker sets on its copy, as rank 0 on its own (rank 0 sets its kernels after
        this: its weights are shared as they were loaded)."""
        self.worker_devices = [device]
        self.device = networks[0].device
        self.dtype = networks[0].dtype
        self._index = {id(network): index for index, network in enumerate(networks)}
        self.workers, port = workers.start(_serve, "omni-cfg-parallel", networks, [device], compile_options,
                                            kernels, graphs)
        self.control = None
        try:
            self.control = workers.join(0, 2, port, self.device)
            workers.share_weights(networks)
        except Exception:
            workers.stop(self.workers, self.control)
            raise
        self._numbers = itertools.count()
        self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # PassCache -> its number
        self._ended: collections.deque[int] = collections.deque()  # passes gone since the last call (any thread)

    def _row(self, state) -> tuple[int, float] | None:
        """A row's cache owner as the worker knows it: (its number, its threshold), None uncached."""
        if state is None:
            return None
        if state not in self._ids:
            number = next(self._numbers)
            self._ids[state] = number
            weakref.finalize(state, self._ended.append, number)  # the request ended: the worker forgets it
        return self._ids[state], state.threshold

    def send(self, network: torch.nn.Module, kwargs: dict, rows: list) -> None:
        """The negatives' pass of ``network`` to the worker: its arguments and each row's cache
        owner (a PassCache or None). Returns once queued; ``receive`` gets the output."""
        workers.check_alive(self.workers, self.worker_devices, "CFG parallel")
        ended = [self._ended.popleft() for _ in range(len(self._ended))]
        workers.send_call(self.control, (), kwargs,
                          (self._index[id(network)], [self._row(state) for state in rows], ended))

    def receive(self, shape: tuple[int, ...], rows: list) -> torch.Tensor:
        """The output (of ``shape``: the step adapter knows it) of the pass ``send`` sent with
        ``rows``, on rank 0's device; the cached rows' owners learn whether their pass computed every
        block. Queue this after rank 0's own pass: rank 0's stream waits for it, and its own pass
        must not."""
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.broadcast(out, src=1)
        if any(state is not None for state in rows):
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=1, group=self.control)
            for state, computed in zip(rows, box[0], strict=True):
                if state is not None:
                    state.computed = computed
        return out

    def close(self) -> None:
        workers.stop(self.workers, self.control)


def _serve(rank: int, world: int, port: int, device: str, specs: list, compile_options: dict | None,
           kernels: NetworkKernels | None, graphs: bool) -> None:
    """The worker: build the networks, take rank 0's weights, then run each negatives' pass rank 0
    sends and send its output back."""
    from triton_omni.diffusion.cuda_graphs import GraphedDenoiser
    from triton_omni.diffusion.runner import compile_blocks
    from triton_omni.diffusion.step_cache import FirstBlockCache, PassCache

    logging.basicConfig(level=logging.INFO, format="CFG parallel worker: %(message)s")
    device = torch.device(device)
    control = workers.join(rank, world, port, device)
    networks = workers.build(specs, device)
    workers.share_weights(networks)
    caches: dict[int, FirstBlockCache] = {}  # each network's step-cache hooks, when a row first asks
    states: dict[int, PassCache] = {}  # each negative pass's cache state, by rank 0's number for it
    for index, network in enumerate(networks):
        if kernels is not None:
            kernels.apply(network)
        if compile_options is not None:
            compile_blocks(network, compile_options)
        if graphs:  # a pass the step cache decides per request runs as it is, as on rank 0
            GraphedDenoiser(network, max_graphs=32,
                            graphable=lambda index=index: caches.get(index) is None or caches[index].rows is None)
    logger.info("%s ready on %s", ", ".join(type(network).__name__ for network in networks), device)
    with torch.inference_mode():
        while (call := workers.receive_call(control, device)) is not None:
            _, kwargs, (index, rows, ended) = call
            for number in ended:
                states.pop(number, None)
            owners = [None if row is None else states.setdefault(row[0], PassCache(row[1])) for row in rows]
            cached = any(owner is not None for owner in owners)
            if cached and index not in caches:
                caches[index] = FirstBlockCache(networks[index])
            cache = caches.get(index)
            with cache.passes(owners) if cache is not None else contextlib.nullcontext():
                out = networks[index](**kwargs)[0]
            dist.broadcast(out.contiguous(), src=1)
            if cached:
                dist.broadcast_object_list([[owner is not None and owner.computed for owner in owners]], src=1,
                                           group=control)
    dist.destroy_process_group()
