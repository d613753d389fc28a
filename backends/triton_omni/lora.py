"""LoRA adapters per request, several in one forward pass, none merged: for the
diffusion transformers (``diffusion``) and for the transformers engine's LLMs
(``ar``, ``ar_encoder``; vLLM runs its own).

A model names the adapters it may use (``lora_adapters``: name -> folder or
file) and how many stay on the device (``max_loras``; the least recently used
unpinned one goes first). Each request names its adapter (``lora``) and
scale (``lora_scale``), or none.

How a batch runs several adapters at once: every linear layer some adapter
targets is wrapped (``LoraLinear``) once, at load, with ``max_loras`` slots of
low-rank factors ``A [slots, rank, in]`` and ``B [slots, out, rank]`` (zero
where an adapter's rank is smaller or it leaves the layer out). A forward
pass gives each of its rows a slot and a scale (``AdapterRows``); the layer
adds ``scale * scaling * B[slot] @ A[slot] @ x`` to each row's base output.
A row without an adapter gets scale 0, so its output is the base layer's bit
for bit, and a pass where no row has one skips the factors altogether. The
shapes never depend on which adapters are loaded, so ``compile: blocks``
compiles a block once for any mix of them: loading an adapter copies its
factors into a slot's existing tensors.

A step-distillation adapter is often used by every request of a server. With
``lora_fuse`` on, a pass whose rows all run one adapter at one scale runs
each layer on a fused copy of its weight (``W + scale * scaling * B @ A``,
as diffusers' ``fuse_lora`` computes it), made when that adapter and scale
first run alone and kept until another pair does: the pass then costs what
a pass without adapters costs. A pass that mixes adapters runs the factors
as above, beside the fused copy, which the base weight never becomes: a row
without an adapter stays the base layer's bit for bit, however often the
server switches. The copy costs one more weight per adapted layer.

What an adapter means is diffusers' and PEFT's. A diffusion adapter's files
are read by the pipeline class's own ``lora_state_dict`` (which converts the
community formats), and its rank and alpha per layer by the ``LoraConfig``
diffusers builds for ``load_lora_weights``, so a request's image is the
pipeline's with ``load_lora_weights(...)`` and ``set_adapters([name],
[scale])`` (``read_pipeline_adapter``). An LLM's adapter is a PEFT folder
(``adapter_config.json``, ``adapter_model.safetensors``), read as
``PeftModel.from_pretrained`` reads it (``read_peft_adapter``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from triton_omni.errors import RequestValidationError

logger = logging.getLogger(__name__)

PREFIX = "transformer"  # where a diffusers LoRA file keeps the denoiser's layers (a UNet's: "unet")


class AdapterError(ValueError):
    """An adapter that cannot be read or does not fit the model, naming it (and the layer)."""


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter as read from its files: per layer, ``(A [r, in], B [out, r], alpha / r)``."""

    name: str
    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


# (name, source) -> the adapter, or AdapterError; a source is a path, or a path per denoiser
Reader = Callable[[str, "str | dict[str, str]"], AdapterWeights]


def read_pipeline_adapter(pipeline, network: torch.nn.Module, name: str, source: str,
                          prefix: str = PREFIX) -> AdapterWeights:
    """A diffusion adapter's factors and scalings, as ``pipeline.load_lora_weights(source)`` would
    load them into ``network``; ``AdapterError`` names the adapter, and the layer where one does not fit."""
    from diffusers.utils.peft_utils import _create_lora_config

    try:
        read = type(pipeline).lora_state_dict(source, return_lora_metadata=True)
    except Exception as exc:  # a missing folder, a corrupt safetensors file, a format diffusers cannot convert
        raise AdapterError(f"LoRA adapter {name!r} ({source}) could not be read: {type(exc).__name__}: {exc}") \
            from None
    # (state, metadata), or (state, network alphas, metadata) where the format keeps alphas apart (FLUX.1)
    state, alphas, metadata = read[0], read[1] if len(read) == 3 else None, read[-1]
    state, alphas, metadata = (None if d is None else {k.removeprefix(f"{prefix}."): v for k, v in d.items()
                                                       if k.startswith(f"{prefix}.")} or None
                               for d in (state, alphas, metadata))
    if state is None:
        raise AdapterError(f"LoRA adapter {name!r} ({source}) has no layers of the {prefix}")
    rank = {f"^{key}": value.shape[1] for key, value in state.items() if "lora_B" in key}
    return _layers(name, state, _create_lora_config(state, alphas, metadata, rank, model_state_dict={},
                                                    adapter_name=name), network)


def read_experts_adapter(pipeline, networks: dict[str, torch.nn.Module], name: str,
                         source: str | dict[str, str]) -> AdapterWeights:
    """An adapter of a pipeline with several denoisers (Wan 2.2 A14B's two experts), read against
    ``networks`` (the pipeline's component name -> its denoiser): a file or folder per component, as
    ``load_lora_weights(path)`` loads one into ``transformer`` and ``load_lora_weights(path,
    load_into_transformer_2=True)`` into ``transformer_2`` (Wan 2.2's step-distillation adapters
    come as such a pair); a plain path is the first denoiser's alone, as ``load_lora_weights(path)``
    loads it. Its layers are named from the component (``transformer_2.blocks.0...``)."""
    parts = source if isinstance(source, dict) else {next(iter(networks)): source}
    unknown = sorted(set(parts) - set(networks))
    if unknown:
        raise AdapterError(f"LoRA adapter {name!r} names {unknown[0]!r}: this pipeline's denoisers are "
                           f"{', '.join(networks)}")
    layers = {}
    for component, path in parts.items():
        read = read_pipeline_adapter(pipeline, networks[component], name, path)
        layers |= {f"{component}.{layer}": factors for layer, factors in read.layers.items()}
    return AdapterWeights(name, layers)


def read_peft_adapter(network: torch.nn.Module, name: str, source: str) -> AdapterWeights:
    """An LLM's PEFT adapter folder, as ``PeftModel.from_pretrained`` loads it onto ``network`` (a
    causal LM, or its base model: ``ar_encoder`` loads no LM head, so the adapter's ``model.``
    prefix is dropped where the network has no such module)."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    if not isinstance(source, str):
        raise AdapterError(f"LoRA adapter {name!r}: an LLM's adapter is one PEFT folder, got {source!r}")
    folder = Path(source)
    try:
        config = LoraConfig.from_pretrained(str(folder))
        state = load_file(str(folder / "adapter_model.safetensors"))
    except Exception as exc:
        raise AdapterError(f"LoRA adapter {name!r} ({source}) could not be read: {type(exc).__name__}: {exc}") \
            from None
    state = {key.removeprefix("base_model.model."): value for key, value in state.items()}
    if not hasattr(network, "model") and all(key.startswith("model.") for key in state):
        state = {key.removeprefix("model."): value for key, value in state.items()}
    return _layers(name, state, config, network)


def _layers(name: str, state: dict[str, torch.Tensor], config, network: torch.nn.Module) -> AdapterWeights:
    """Each adapted layer's ``(A, B, alpha / r)``, checked against ``network``'s layer."""
    from peft.utils.other import get_pattern_key

    unsupported = sorted({key.rsplit(".", 1)[0] for key in state
                          if (".lora_A." not in key and ".lora_B." not in key) or key.endswith("lora_B.bias")})
    if unsupported:
        raise AdapterError(f"LoRA adapter {name!r}: only plain LoRA factors are served (lora_A, lora_B weights), "
                           f"found {unsupported[0]}")
    if config.use_dora:
        raise AdapterError(f"LoRA adapter {name!r} is a DoRA adapter: not served")
    modules = dict(network.named_modules())
    layers = {}
    for key in sorted(state):
        if not key.endswith(".lora_A.weight"):
            continue
        layer = key.removesuffix(".lora_A.weight")
        a, b = state[key], state.get(f"{layer}.lora_B.weight")
        base = modules.get(layer)
        base = base.base if isinstance(base, LoraLinear) else base  # adapted already (a load after the first)
        if not isinstance(base, torch.nn.Linear):
            what = "no such layer" if base is None else f"a {type(base).__name__}, not a Linear"
            raise AdapterError(f"LoRA adapter {name!r} does not fit this model: {layer} ({what})")
        if b is None or a.dim() != 2 or b.dim() != 2 or a.shape[1] != base.in_features or \
                b.shape[0] != base.out_features or a.shape[0] != b.shape[1]:
            got = "no lora_B" if b is None else f"A {tuple(a.shape)}, B {tuple(b.shape)}"
            raise AdapterError(f"LoRA adapter {name!r} does not fit this model at {layer}: the layer is "
                               f"{base.in_features} -> {base.out_features}, the adapter's factors are {got}")
        r = a.shape[0]
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), layer), config.lora_alpha)
        layers[layer] = (a, b, alpha / (math.sqrt(r) if config.use_rslora else r))
    if not layers:
        raise AdapterError(f"LoRA adapter {name!r} has no LoRA layers")
    return AdapterWeights(name, layers)


class AdapterRows:
    """Whose rows a forward pass runs: each row's slot and scale (one entry: every row's), read by
    every ``LoraLinear``. None: no row has an adapter."""

    def __init__(self, fuse: Callable[[tuple[int, float]], None] | None = None) -> None:
        self.slots: torch.Tensor | None = None  # [rows] int64
        self.scales: torch.Tensor | None = None  # [rows] float32: 0 for a row without an adapter
        # fuse((slot, scale)): the layers' fused weights made that pair's (None: lora_fuse off)
        self.fuse = fuse
        self.fused = False  # this pass runs the fused weights (a bool: compiled code guards on it)

    @contextlib.contextmanager
    def bind(self, rows: list[tuple[int, float] | None], device: torch.device,
             size: int | None = None) -> Iterator[None]:
        """A forward pass whose row ``i`` uses ``rows[i]`` ((slot, scale), or None), padded to
        ``size`` rows (padding takes whatever keeps the pass cheapest: its output is thrown away)."""
        if all(row is None for row in rows):
            yield
            return
        if len(set(rows)) == 1 and self.fuse is not None:  # one adapter for all, fused into the weights
            self.fuse(rows[0])
            self.fused = True
            try:
                yield
            finally:
                self.fused = False
            return
        # one adapter for all: one entry, which fits any leading dimension; else a row each, padding none
        rows = rows[:1] if len(set(rows)) == 1 else rows + [None] * ((size or len(rows)) - len(rows))
        slots = [row[0] if row else 0 for row in rows]
        scales = [row[1] if row else 0.0 for row in rows]
        self.slots = torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True)
        self.scales = torch.tensor(scales, dtype=torch.float32).to(device, non_blocking=True)
        try:
            yield
        finally:
            self.slots = self.scales = None

    @contextlib.contextmanager
    def narrowed(self, rows: torch.Tensor) -> Iterator[None]:
        """Only ``rows`` of the bound pass run (the step cache's rows that compute)."""
        slots, scales = self.slots, self.scales
        if slots is not None and slots.shape[0] > 1:
            self.slots, self.scales = slots.index_select(0, rows), scales.index_select(0, rows)
        try:
            yield
        finally:
            self.slots, self.scales = slots, scales


class LoraLinear(torch.nn.Module):
    """A linear layer with ``slots`` adapters' factors beside it, applied per row (module docstring)."""

    def __init__(self, base: torch.nn.Linear, rank: int, slots: int, rows: AdapterRows, name: str):
        super().__init__()
        self.base, self.rows, self.name = base, rows, name
        weight = base.weight
        self.register_buffer("lora_a", weight.new_zeros(slots, rank, base.in_features), persistent=False)
        self.register_buffer("lora_b", weight.new_zeros(slots, base.out_features, rank), persistent=False)
        self.register_buffer("scaling", torch.zeros(slots, device=weight.device), persistent=False)
        self.register_buffer("fused_weight", None, persistent=False)  # lora_fuse's copy (Adapters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows.fused:
            return torch.nn.functional.linear(x, self.fused_weight, self.base.bias)
        out = self.base(x)
        slots, scales = self.rows.slots, self.rows.scales
        if slots is None:
            return out
        n = slots.shape[0]
        if n > 1 and x.shape[0] != n:
            raise RuntimeError(f"{self.name} got {x.shape[0]} rows in a pass bound to {n}: its input does not "
                               "keep one row per request (the family's lora_flattened should name it)")
        h = x.reshape(n, -1, x.shape[-1]).to(self.lora_a.dtype)
        delta = torch.bmm(torch.bmm(h, self.lora_a.index_select(0, slots).transpose(1, 2)),
                          self.lora_b.index_select(0, slots).transpose(1, 2))
        weight = (scales * self.scaling.index_select(0, slots)).to(delta.dtype)
        return out + (delta * weight.view(n, 1, 1)).reshape(out.shape).to(out.dtype)

    def fuse(self, slot: int, scale: float) -> None:
        """``fused_weight``: the base weight with ``slot``'s adapter at ``scale`` added, in float32
        then rounded once, as diffusers' ``fuse_lora`` adds it."""
        delta = (scale * self.scaling[slot]) * (self.lora_b[slot].float() @ self.lora_a[slot].float())
        self.fused_weight.copy_(self.base.weight.float() + delta)

    def install(self, slot: int, factors: tuple[torch.Tensor, torch.Tensor, float] | None) -> None:
        """An adapter's factors into ``slot`` (None: the adapter leaves this layer out)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scaling[slot] = 0.0
        if factors is not None:
            a, b, scaling = factors
            self.lora_a[slot, : a.shape[0]].copy_(a)
            self.lora_b[slot, :, : b.shape[1]].copy_(b)
            self.scaling[slot] = scaling


@dataclass
class _Slot:
    name: str | None = None  # the adapter it holds
    pins: int = 0  # requests in flight on it


class Adapters:
    """A model's adapters: the configured ones, checked at load; the ``max_loras`` slots on the
    device, filled on a request's first use (read on a loader thread, copied on the model's torch
    thread by ``run``), pinned while a request uses them, the least recently used unpinned one
    emptied first; the counts the metrics report."""

    def __init__(self, network: torch.nn.Module, read: Reader, sources: dict[str, str], max_loaded: int,
                 flattened: tuple[str, ...] = (), run: Callable[[Callable[[], None]], None] = lambda fn: fn(),
                 on_event: Callable[[str, str], None] | None = None, fuse: bool = False):
        """``read(name, source)``: an adapter's weights (``read_pipeline_adapter``,
        ``read_peft_adapter``); ``run(fn)``: ``fn`` on the model's torch thread, returning when it is
        done; ``on_event(event, adapter)``: each ``request``, ``load`` and ``eviction`` (the metrics);
        ``fuse``: a pass whose rows share one adapter runs it fused (``lora_fuse``, module docstring)."""
        if not sources:
            raise ValueError("no LoRA adapters configured")
        if max_loaded < 1:
            raise ValueError(f"model parameter max_loras must be at least 1, got {max_loaded}")
        self.network, self.read, self.sources, self.run = network, read, sources, run
        self.on_event = on_event or (lambda event, name: None)
        weight = next(network.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        ranks: dict[str, int] = {}
        for name, source in sources.items():  # every adapter read once now: one that does not fit fails the load
            for layer, (a, _, _) in read(name, source).layers.items():
                if layer.startswith(flattened):
                    raise AdapterError(f"LoRA adapter {name!r} targets {layer}, whose input holds every request's "
                                       "tokens at once: adapters per request cannot apply there")
                ranks[layer] = max(ranks.get(layer, 0), a.shape[0])
        self.rows = AdapterRows(self._fuse if fuse else None)
        self._fused: tuple[int, float] | None = None  # the (slot, scale) the fused weights hold
        self.layers = self._wrap(ranks, min(max_loaded, len(sources)))
        if fuse:  # at load, where the memory plan sees them, not at the first shared pass
            for layer in self.layers.values():
                layer.fused_weight = torch.empty_like(layer.base.weight)
        self.slots = [_Slot() for _ in range(min(max_loaded, len(sources)))]
        self._lru: OrderedDict[str, int] = OrderedDict()  # resident adapter -> slot, least recent first
        self._loading: dict[str, Future] = {}
        self._lock = threading.Condition()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="omni-lora-loader")
        self.counts: Counter[tuple[str, str]] = Counter()  # (event, adapter) -> times
        logger.info("LoRA: %d adapters (%s), %d slots on %s, %d layers adapted", len(sources),
                    ", ".join(sources), len(self.slots), self.device, len(self.layers))

    def _wrap(self, ranks: dict[str, int], slots: int) -> dict[str, LoraLinear]:
        layers = {}
        for name, rank in ranks.items():
            parent, _, child = name.rpartition(".")
            owner = self.network.get_submodule(parent) if parent else self.network
            layers[name] = LoraLinear(getattr(owner, child), rank, slots, self.rows, name)
            setattr(owner, child, layers[name])
        return layers

    def check(self, name: str) -> None:
        if name not in self.sources:
            raise RequestValidationError("lora", f"unknown adapter; this model serves {sorted(self.sources)}", name)

    def acquire(self, name: str) -> Future:
        """A future of the slot holding ``name``, pinned until ``release``: at once if it is
        resident, else once it is read and copied in (other requests keep stepping meanwhile)."""
        self.check(name)
        self._count("request", name)
        with self._lock:
            slot = self._lru.get(name)
            if slot is not None:
                self._lru.move_to_end(name)
                self.slots[slot].pins += 1
                done: Future = Future()
                done.set_result(slot)
                return done
            if name not in self._loading:
                self._loading[name] = self._loader.submit(self._load, name)
            loading = self._loading[name]
        pinned: Future = Future()
        loading.add_done_callback(lambda f: self._pin_after_load(name, f, pinned))
        return pinned

    def _pin_after_load(self, name: str, loaded: Future, pinned: Future) -> None:
        if loaded.exception() is not None:
            pinned.set_exception(loaded.exception())
            return
        with self._lock:
            slot = self._lru.get(name)
            if slot is None:  # emptied again before this request pinned it (many adapters, few slots): reload
                if name not in self._loading:
                    self._loading[name] = self._loader.submit(self._load, name)
                self._loading[name].add_done_callback(lambda f: self._pin_after_load(name, f, pinned))
                return
            self.slots[slot].pins += 1
        pinned.set_result(slot)

    def release(self, slot: int) -> None:
        with self._lock:
            self.slots[slot].pins -= 1
            self._lock.notify_all()

    def _load(self, name: str) -> int:
        """On the loader thread: read the adapter, move it to the device, wait for a free slot, copy it
        in (on the model's torch thread)."""
        try:
            weights = self.read(name, self.sources[name])
            factors = {layer: (a.to(self.device, self.dtype), b.to(self.device, self.dtype), scaling)
                       for layer, (a, b, scaling) in weights.layers.items()}
            slot = self._free_slot()
            self.run(lambda: self._install(slot, factors))
            with self._lock:
                self.slots[slot].name = name
                self._lru[name] = slot
            self._count("load", name)
            logger.info("LoRA adapter %r loaded into slot %d", name, slot)
            return slot
        finally:
            with self._lock:
                self._loading.pop(name, None)

    def _install(self, slot: int, factors: dict) -> None:
        """On the torch thread: ``factors`` into ``slot`` of every layer (a fused copy of the adapter
        that held it is stale now)."""
        for name, layer in self.layers.items():
            layer.install(slot, factors.get(name))
        if self._fused is not None and self._fused[0] == slot:
            self._fused = None

    def _fuse(self, pair: tuple[int, float]) -> None:
        """On the torch thread, before a pass whose rows all run ``pair`` (slot, scale): every
        layer's fused weight made that pair's, unless it already is."""
        if self._fused != pair:
            self._fused = None  # a fuse that fails halfway leaves no pair named
            for layer in self.layers.values():
                layer.fuse(*pair)
            self._fused = pair
            logger.debug("LoRA: slot %d at scale %g fused into %d layers' copies", pair[0], pair[1], len(self.layers))

    def _free_slot(self) -> int:
        """An empty slot, or the least recently used unpinned one, emptied (waits while all are pinned)."""
        with self._lock:
            while True:
                for index, slot in enumerate(self.slots):
                    if slot.name is None:
                        return index
                for name, index in self._lru.items():
                    if self.slots[index].pins == 0:
                        del self._lru[name]
                        self.slots[index].name = None
                        self._count("eviction", name)
                        logger.info("LoRA adapter %r evicted from slot %d", name, index)
                        return index
                self._lock.wait()

    def _count(self, event: str, name: str) -> None:
        self.counts[event, name] += 1
        self.on_event(event, name)

    def resident(self) -> list[str]:
        with self._lock:
            return list(self._lru)

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)


def parse_sources(text: str, base: Path | None = None) -> dict[str, str | dict[str, str]]:
    """The ``lora_adapters`` model parameter: a JSON object, adapter name -> folder, file or hub id,
    or (a family with several denoisers, Wan 2.2 A14B) an object of the pipeline's denoiser
    components to those, ``{"transformer": ..., "transformer_2": ...}``. A relative path is taken
    from ``base``, the model's folder."""
    try:
        sources = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"model parameter lora_adapters must be a JSON object (name -> path): {exc}") from None

    def path(value) -> bool:
        return isinstance(value, str) and bool(value)

    def source(value) -> bool:  # a path, or a path per denoiser component
        if isinstance(value, dict):
            return bool(value) and all(path(component) and path(p) for component, p in value.items())
        return path(value)

    if not isinstance(sources, dict) or not all(path(k) and source(v) for k, v in sources.items()):
        raise ValueError("model parameter lora_adapters must be a JSON object of names to paths (or, per "
                         'denoiser, to objects such as {"transformer": path, "transformer_2": path})')
    if base is not None:
        def resolved(v: str) -> str:
            return str(base / v) if not Path(v).is_absolute() and (base / v).exists() else v

        sources = {k: resolved(v) if isinstance(v, str) else {c: resolved(p) for c, p in v.items()}
                   for k, v in sources.items()}
    return sources
