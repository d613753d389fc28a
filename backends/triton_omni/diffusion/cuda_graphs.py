"""The denoiser's forward, captured once per input shape as a CUDA graph and
replayed at every step.

Why: a step is hundreds to thousands of kernels, each launched from Python
(an SD1.5 UNet's), or from torch.compile's wrappers with their guards (a DiT's
blocks under ``compile: blocks``; with FP8, every linear layer adds the
kernels that quantize its input). Where the GPU finishes them faster than the
host issues them, the step time follows the host. A replayed graph launches
the whole forward in one call.

What is graphed: any call of the denoiser with ``return_dict=False`` whose
arguments are tensors (copied into the graph's own inputs at each replay)
and plain values other than floats (ints, strings, None, nested lists and
tuples of them: part of the graph's key, so that ``img_shapes`` or a token
count picks its own graph). A float or a value that does not hash,
``return_dict=True``, or a call the runner marks as not graphable (a pass
with the step cache's per-request decisions, which read the GPU from
Python) runs eagerly, as does a shape whose capture failed. Graphs share
one memory pool, since one runner replays them one at a time.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

logger = logging.getLogger(__name__)

_EAGER = None  # a cache entry for a shape that could not be captured


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # static inputs: each replay reads them...
    output: Any  # ...and overwrites this (a tensor, or Z-Image's list of one per row)

    def replay(self, tensors: list[torch.Tensor]) -> Any:
        for static, tensor in zip(self.inputs, tensors, strict=True):
            static.copy_(tensor)
        self.graph.replay()
        return tree_map(torch.clone, self.output)  # the next replay overwrites the static output


class _Call:
    """One call's arguments split into its tensors and the rest (its key's constant part)."""

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs
        leaves, self.spec = tree_flatten((args, kwargs))
        self.slots = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf)]
        self.tensors = [leaves[i] for i in self.slots]
        self.leaves = leaves
        constants = tuple(leaf for leaf in leaves if not torch.is_tensor(leaf))
        self.key = (tuple((tuple(t.shape), t.dtype, t.device) for t in self.tensors), str(self.spec), constants)
        self.graphable = bool(self.tensors) and not any(isinstance(c, float) for c in constants) and _hashable(self.key)

    def with_tensors(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        """The call's (args, kwargs) with ``tensors`` in its tensors' places."""
        leaves = list(self.leaves)
        for slot, tensor in zip(self.slots, tensors, strict=True):
            leaves[slot] = tensor
        return tree_unflatten(leaves, self.spec)


class GraphedDenoiser:
    """Installs itself as ``module.forward``; ``nn.Module.__call__`` finds
    the instance attribute first, so the pipeline's code is unchanged.

    A shape's first call runs eagerly on a side stream: that is the warm-up
    ``torch.cuda.graph`` asks for (lazy initialisation, kernel selection and
    torch.compile's compilation outside the capture), and it does the step's
    real work, so a new shape costs no extra forward pass. Its second call is
    captured, and every later one replays: the first 20-step batch of a shape
    runs 1 eager step and 19 replays.

    ``max_graphs`` bounds the cache (least recently used out): each key is one
    set of input shapes and constants, and without exact batching the batch
    size varies with the load (the step engine pads it to a few buckets).
    ``graphable()``: whether this call may replay (None: always).
    """

    def __init__(self, module: torch.nn.Module, max_graphs: int = 16,
                 on_capture: Callable[[], None] | None = None, graphable: Callable[[], bool] | None = None):
        """``on_capture()``: after each capture (the graph-captures metric: a
        capture in steady state means the warm-up missed a shape)."""
        self._module = module
        self._eager = module.forward
        self._on_capture = on_capture
        self._graphable = graphable
        self._max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _Graph | None] = OrderedDict()
        self._warmed: OrderedDict[tuple, None] = OrderedDict()  # shapes run once, not yet captured
        self._pool = torch.cuda.graph_pool_handle()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # warm-up and capture streams, one per GPU
        self.enabled = True  # off: every call eager (the benchmark's raw-diffusers reference)
        module.forward = self.forward

    @property
    def captured(self) -> int:
        return sum(graph is not None for graph in self._graphs.values())

    def shapes(self) -> list[tuple]:
        """The input shapes of every call met (captured or warmed up), each a tuple of shapes."""
        return [tuple(shape for shape, _, _ in key[0]) for key in (*self._graphs, *self._warmed)]

    def remove(self) -> None:
        """The module's own forward back, every graph released."""
        self._module.__dict__.pop("forward", None)
        self._graphs.clear()
        self._warmed.clear()
        _clear_cublas_workspaces()

    def forward(self, *args, **kwargs):
        if not self.enabled or kwargs.get("return_dict", True) or (self._graphable and not self._graphable()):
            return self._eager(*args, **kwargs)
        call = _Call(args, kwargs)
        if not call.graphable:
            return self._eager(*args, **kwargs)
        # Streams and captures belong to the thread's current device, GPU 0 unless set: a
        # runner on cuda:1 without this captures no graph at all.
        with torch.cuda.device(call.tensors[0].device):
            return (self._graphed(call),)

    def _graphed(self, call: _Call) -> Any:
        key = call.key
        if key not in self._graphs:
            if key not in self._warmed:
                _remember(self._warmed, key, 256)
                return self._warm_up(call)
            del self._warmed[key]
            _remember(self._graphs, key, self._max_graphs, self._capture(call))
        self._graphs.move_to_end(key)
        graph = self._graphs[key]
        if graph is _EAGER:
            return self._eager(*call.args, **call.kwargs)[0]
        return graph.replay(call.tensors)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """This GPU's side stream, for warm-ups and captures. One, made once: torch.cuda.graph's
        default is made once per process, on whichever GPU captured first (a capture on another
        GPU then fails), and each new stream costs a cuBLAS workspace for the process's life."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _warm_up(self, call: _Call) -> Any:
        ambient = torch.cuda.current_stream()
        side = self._stream(call.tensors[0].device)
        side.wait_stream(ambient)
        with torch.cuda.stream(side):
            output = self._eager(*call.args, **call.kwargs)[0]
        ambient.wait_stream(side)
        for tensor in tree_leaves(output):
            tensor.record_stream(ambient)  # made on the side stream, used on the ambient one
        return output

    def _capture(self, call: _Call) -> _Graph | None:
        static = [t.clone() for t in call.tensors]
        args, kwargs = call.with_tensors(static)
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: the stub's other threads may touch CUDA while this one captures
            _clear_cublas_workspaces()  # made in the capture, in the pool: the graph keeps what it uses
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream(static[0].device),
                                  capture_error_mode="thread_local"):
                output = self._eager(*args, **kwargs)[0]
            _clear_cublas_workspaces()  # else the workspace map would hold the pool past the graphs' release
        except Exception:
            logger.exception("CUDA graph capture failed for %s; this shape runs eagerly", _describe(static))
            return _EAGER
        logger.info("Captured a CUDA graph of the denoiser for %s", _describe(static))
        if self._on_capture is not None:
            self._on_capture()
        return _Graph(graph, static, output)


def _remember(cache: OrderedDict, key: tuple, size: int, value: Any = None) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)


def _hashable(key: tuple) -> bool:
    """Whether ``key`` can key the cache: an argument of a type pytree does not open (an object of
    the caller's) may not hash."""
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _clear_cublas_workspaces() -> None:
    """Drops cuBLAS's workspaces (one per stream it ran on, kept for the process's life), as
    PyTorch's own CUDA graphs do around each capture (torch/_inductor/cudagraph_trees.py)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # absent from CPU builds
    if clear is not None:
        clear()


def _describe(tensors: list[Any]) -> str:
    return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
