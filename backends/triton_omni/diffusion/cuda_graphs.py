"""The denoiser's forward, captured once per input shape as a CUDA graph and
replayed at every step.

Why: an SD1.5 UNet step is about a thousand kernels, each launched from
Python. At small batches the GPU finishes them faster than eager PyTorch can
issue them, so the step time follows the interpreter. A replayed graph
launches the whole forward in one call; the gain is largest at batch 1 and
fades as batches grow.

What is graphed: ``unet(sample, timestep, encoder_hidden_states,
return_dict=False)`` with no extra conditioning, which is every step of the
SD-family pipelines. Any other call (ControlNet residuals, added conditions,
``return_dict=True``) runs eagerly, as does a shape whose capture failed.
Graphs share one memory pool, since one runner replays them one at a time.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

_EAGER = None  # a cache entry for a shape that could not be captured


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    sample: torch.Tensor  # static inputs: each replay reads them...
    timestep: torch.Tensor
    encoder_hidden_states: torch.Tensor
    output: torch.Tensor  # ...and overwrites this

    def replay(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor):
        self.sample.copy_(sample)
        self.timestep.copy_(timestep)
        self.encoder_hidden_states.copy_(encoder_hidden_states)
        self.graph.replay()
        return self.output.clone()  # the next replay overwrites the static output


class GraphedDenoiser:
    """Installs itself as ``module.forward``; ``nn.Module.__call__`` finds
    the instance attribute first, so the pipeline's code is unchanged.

    A shape's first call runs eagerly on a side stream: that is the warm-up
    ``torch.cuda.graph`` asks for (lazy initialisation and kernel selection
    outside the capture), and it does the step's real work, so a new shape
    costs no extra forward pass. Its second call is captured, and every
    later one replays: the first 20-step batch of a shape runs 1 eager step
    and 19 replays.

    ``max_graphs`` bounds the cache (least recently used out): each key is
    one (batch, latent size, token count, dtype), and without exact batching
    the batch size varies with the load.
    """

    def __init__(self, module: torch.nn.Module, max_graphs: int = 16,
                 on_capture: Callable[[], None] | None = None):
        """``on_capture()``: after each capture (the graph-captures metric: a
        capture in steady state means the warm-up missed a shape)."""
        self._eager = module.forward
        self._on_capture = on_capture
        self._max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _Graph | None] = OrderedDict()
        self._warmed: OrderedDict[tuple, None] = OrderedDict()  # shapes run once, not yet captured
        self._pool = torch.cuda.graph_pool_handle()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # capture streams, one per GPU
        self.enabled = True  # off: every call eager (the benchmark's raw-diffusers reference)
        module.forward = self.forward

    @property
    def captured(self) -> int:
        return sum(graph is not None for graph in self._graphs.values())

    def forward(self, sample, timestep, encoder_hidden_states=None, *args, return_dict: bool = True, **kwargs):
        plain = not args and not return_dict and encoder_hidden_states is not None and all(map(_unset, kwargs.values()))
        if not (self.enabled and plain):
            return self._eager(sample, timestep, encoder_hidden_states, *args, return_dict=return_dict, **kwargs)
        if not torch.is_tensor(timestep):
            timestep = torch.tensor(timestep, device=sample.device)
        # Streams and captures belong to the thread's current device, GPU 0 unless set: a
        # runner on cuda:1 without this captures no graph at all.
        with torch.cuda.device(sample.device):
            return self._graphed((sample, timestep, encoder_hidden_states))

    def _graphed(self, inputs: tuple[torch.Tensor, ...]):
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)
        if key not in self._graphs:
            if key not in self._warmed:
                _remember(self._warmed, key, 256)
                return (self._warm_up(*inputs),)
            del self._warmed[key]
            _remember(self._graphs, key, self._max_graphs, self._capture(*inputs))
        self._graphs.move_to_end(key)
        graph = self._graphs[key]
        if graph is _EAGER:
            return self._eager(*inputs, return_dict=False)
        return (graph.replay(*inputs),)

    def _warm_up(self, *inputs: torch.Tensor) -> torch.Tensor:
        ambient = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(ambient)
        with torch.cuda.stream(side):
            output = self._eager(*inputs, return_dict=False)[0]
        ambient.wait_stream(side)
        output.record_stream(ambient)  # made on the side stream, used on the ambient one
        return output

    def _capture(self, *inputs: torch.Tensor) -> _Graph | None:
        static = [t.clone() for t in inputs]
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: the stub's other threads may touch CUDA while this one captures
            # its own capture stream: torch.cuda.graph's default one is made once per process, on
            # whichever GPU captured first, and a capture on another GPU then fails
            device = static[0].device
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            with torch.cuda.graph(graph, pool=self._pool, stream=self._streams[device],
                                  capture_error_mode="thread_local"):
                output = self._eager(*static, return_dict=False)[0]
        except Exception:
            logger.exception("CUDA graph capture failed for %s; this shape runs eagerly", _describe(static))
            return _EAGER
        logger.info("Captured a CUDA graph of the denoiser for %s", _describe(static))
        if self._on_capture is not None:
            self._on_capture()
        return _Graph(graph, *static, output)


def _remember(cache: OrderedDict, key: tuple, size: int, value: Any = None) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)


def _unset(value: Any) -> bool:
    """What the SD pipelines pass for conditioning they do not use."""
    return value is None or (isinstance(value, dict) and not value)


def _describe(tensors: list[Any]) -> str:
    return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
