"""The talker's step on a GPU as CUDA graphs, over a KV cache of fixed buffers.

A talker step is one forward pass of the talker (Qwen3-Omni's 20-layer MoE, Qwen2.5-Omni's dense
decoder) for every running utterance; run from Python it costs the host's time to launch its
kernels, not the GPU's (``benchmarks/speech_step.py``
splits a step into its parts). A CUDA graph replays those launches at once, but needs every
tensor at a fixed address and every shape fixed, and a growing, left-padded ``DynamicCache``
(``PaddedCache``) is neither. So here the running rows' keys and values live in buffers made
once (``SlotCache``): row ``i`` in slot ``i``, its positions at columns ``0 .. writes[i] - 1``,
its next written at column ``writes[i]`` (a device tensor, so a replay needs no host value), and
its position is that column plus its prompt's shift (``shifts[i]``: not zero after an image's
rows and columns). A step of ``n`` rows replays the graph of the smallest captured
batch that holds them (the others padded, each seeing only its column 0) and the smallest
captured width that holds the longest row: attention then reads that width, not the whole
buffer.

An utterance joining alone is prefilled the same way (``TalkerPrefill``): its prompt at the first
columns of the smallest captured width that holds it, the padding after it (the attention is
causal, so no position of the prompt reads the padding), its keys and values written straight
into its slot. Run from Python, that prefill cost about as much as a step, and the first audio
waits for it. Utterances joining together are prefilled in one eager pass (``add_rows``).

``TalkerSteps`` also runs without capturing (the CPU tests hold it to the ``PaddedCache`` path).
A row cannot outgrow the buffer: the runner refuses (or bounds) an utterance whose prompt and
``max_tokens`` exceed ``talker_max_len``, as vLLM does with ``max_model_len``.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from triton_omni.ar.batching import to_device
from triton_omni.speech.predictor_graphs import CAPTURED_ROWS, captured, compiling
from triton_omni.speech.talker_regions import CompiledRegions

logger = logging.getLogger(__name__)

SMALLEST_WIDTH = 256  # the captured widths: 256, 512, 1024, ... up to the buffer's
# a lone prompt's prefill widths: 64, 128, ... 2048 (a longer prompt is prefilled eagerly)
SMALLEST_PREFILL, LARGEST_PREFILL = 64, 2048


def _widths(smallest: int, largest: int) -> list[int]:
    """``smallest``, twice that, ... and ``largest``."""
    return [w for w in (smallest << k for k in range(32)) if w < largest] + [largest]


class SlotCache:
    """Every running row's keys and values, a slot per row, in buffers made once.

    Its interface is ``PaddedCache``'s (``add``, ``add_rows``, ``keep``, ``clear``), so the
    batch loop admits and drops rows alike on either."""

    def __init__(self, config, rows: int, capacity: int, device: torch.device, dtype: torch.dtype):
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (rows, heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.capacity = capacity
        # each slot's next column; a slot with no row keeps 0, so that a padding row sees one column
        self.writes = torch.zeros(rows, dtype=torch.long, device=device)
        self.shifts = torch.zeros(rows, dtype=torch.long, device=device)  # each slot's position less its column
        self.lengths: list[int] = []  # the running rows' ``writes``, as the host knows them

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def clear(self) -> None:
        self.writes.zero_()
        self.shifts.zero_()
        self.lengths = []

    def shift(self, first: int, shifts: list[int]) -> None:
        """Rows ``first``, ``first + 1``, ...: each position its column plus its shift (a slot with no
        row, or a row added without one, has none)."""
        self.shifts[first:first + len(shifts)].copy_(to_device(shifts, torch.long, self.shifts.device))

    def add(self, cache, length: int) -> None:
        self.add_rows(cache, torch.ones(1, length, dtype=torch.long, device=self.writes.device))

    def add_rows(self, cache, mask: torch.Tensor) -> None:
        """Rows joining: ``cache`` (a ``DynamicCache``) of a prefill whose prompts were left-padded
        to one length, ``mask`` [rows, length] 0 over the padding. Each row's positions are
        copied to its slot's first columns."""
        joining, length = mask.shape
        first = self.rows
        lengths = mask.sum(dim=1)
        # column c of a row takes its prefill's column c + padding (the columns past its length, unread)
        source = (torch.arange(length, device=mask.device)[None, :] + (length - lengths)[:, None]).clamp(max=length - 1)
        for layer, keys, values in zip(cache.layers, self.keys, self.values, strict=True):
            index = source[:, None, :, None].expand_as(layer.keys)
            keys[first:first + joining, :, :length].copy_(layer.keys.gather(2, index))
            values[first:first + joining, :, :length].copy_(layer.values.gather(2, index))
        self.writes[first:first + joining].copy_(lengths)
        self.lengths.extend(lengths.tolist())

    def keep(self, rows: list[int]) -> None:
        """Keep these rows, in this order, in the first slots."""
        if not rows:
            self.clear()
            return
        moved = next((slot for slot, row in enumerate(rows) if row != slot), None)
        if moved is not None:  # the rows before it stay where they are
            index = to_device(rows[moved:], torch.long, self.writes.device)
            for buffer in (*self.keys, *self.values, self.writes, self.shifts):
                buffer[moved:len(rows)].copy_(buffer.index_select(0, index))
        self.writes[len(rows):].zero_()
        self.shifts[len(rows):].zero_()
        self.lengths = [self.lengths[row] for row in rows]

    def advance(self, kept: list[bool] | None = None) -> None:
        """Every running row (each ``kept`` one) wrote one more column; a row not kept writes its
        next step at the same column again."""
        if kept is None:
            self.writes[:self.rows] += 1
            self.lengths = [n + 1 for n in self.lengths]
        else:
            self.writes[:self.rows] += to_device(kept, torch.long, self.writes.device)
            self.lengths = [n + keep for n, keep in zip(self.lengths, kept, strict=True)]


class _SlotLayers:
    """What the talker's attention layers call as their cache (``update``): the first ``rows``
    slots and ``width`` columns of a ``SlotCache``, each row's keys written at its own column."""

    def __init__(self, cache: SlotCache, rows: int, width: int):
        self.keys = [k[:rows, :, :width] for k in cache.keys]
        self.values = [v[:rows, :, :width] for v in cache.values]
        self.index: torch.Tensor | None = None  # [rows, heads, 1, head_dim]: each row's column

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *_) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer].scatter_(2, self.index, keys)
        self.values[layer].scatter_(2, self.index, values)
        return self.keys[layer], self.values[layer]


class TalkerStep:
    """One talker step for ``rows`` rows reading ``width`` columns, every tensor allocated once:
    ``inputs`` [rows, 1, hidden] in; ``hidden`` (each row's last layer's state, the code
    predictor's input) and ``logits`` (its first codebook's) out."""

    def __init__(self, talker, cache: SlotCache, rows: int, width: int, regions=None):
        """``regions``: the talker's ``CompiledRegions``, which its passes run (none: transformers' layers)."""
        self.talker, self.cache, self.rows = talker, cache, rows
        self.regions = regions
        with torch.inference_mode():  # as every layer's input is (compiled regions: one variant for all layers)
            self.inputs = torch.zeros(rows, 1, talker.model.config.hidden_size, device=cache.writes.device,
                                      dtype=cache.keys[0].dtype)
        self.columns = torch.arange(width, device=cache.writes.device)
        self.layers = _SlotLayers(cache, rows, width)
        self.hidden = self.logits = None

    @torch.inference_mode()
    def run(self) -> None:
        writes = self.cache.writes[:self.rows]
        key = self.cache.keys[0]
        self.layers.index = writes.view(-1, 1, 1, 1).expand(self.rows, key.shape[1], 1, key.shape[3])
        mask = (self.columns[None, :] <= writes[:, None])[:, None, None, :]  # its own positions and the new one
        positions = (writes + self.cache.shifts[:self.rows])[None, :, None].expand(3, -1, -1)  # column + shift
        with self.regions.running() if self.regions is not None else contextlib.nullcontext():
            out = self.talker.model(inputs_embeds=self.inputs, attention_mask=mask, position_ids=positions,
                                    past_key_values=self.layers, use_cache=True, output_hidden_states=True)
        self.hidden = out.hidden_states[-1][:, -1:]
        self.logits = self.talker.codec_head(out.last_hidden_state[:, -1])


class _PrefillLayers:
    """What the talker's attention layers call as their cache during a lone prompt's prefill: each
    layer's keys and values written to one slot's first ``width`` columns (``slot`` a device
    tensor), and the prompt's own keys and values attended to."""

    def __init__(self, cache: SlotCache, width: int):
        self.keys = [k[:, :, :width] for k in cache.keys]
        self.values = [v[:, :, :width] for v in cache.values]
        self.slot = torch.zeros(1, dtype=torch.long, device=cache.writes.device)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *_) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer].index_copy_(0, self.slot, keys)
        self.values[layer].index_copy_(0, self.slot, values)
        return keys, values


class TalkerPrefill:
    """One prompt of at most ``width`` positions prefilled into a slot, every tensor allocated once:
    ``embeds`` [1, width, hidden] in (the prompt first, zeros after it) and ``positions`` [3, 1, width]
    (its rotary positions: each column's own, or a prompt with images' rows and columns); ``hidden``
    (the last layer's states, the code predictor's input) and ``last`` (the normed states, the codec
    head's) out, at every column (the prompt's last is the one read)."""

    def __init__(self, talker, cache: SlotCache, width: int):
        self.talker = talker
        device = cache.writes.device
        self.embeds = torch.zeros(1, width, talker.model.config.hidden_size, device=device, dtype=cache.keys[0].dtype)
        self.layers = _PrefillLayers(cache, width)
        self.mask = torch.ones(width, width, dtype=torch.bool, device=device).tril()[None, None]
        self.columns = torch.arange(width, device=device)[None].expand(3, -1)
        self.positions = self.columns[:, None].clone()
        self.hidden = self.last = None

    @torch.inference_mode()
    def run(self) -> None:
        out = self.talker.model(inputs_embeds=self.embeds, attention_mask=self.mask, position_ids=self.positions,
                                past_key_values=self.layers, use_cache=True, output_hidden_states=True)
        self.hidden, self.last = out.hidden_states[-1], out.last_hidden_state


class TalkerSteps:
    """The talker's steps over one ``SlotCache``: a ``TalkerStep`` per captured batch size (up to
    ``max_rows``) and width (up to ``capacity``), each captured as a CUDA graph where ``capture``
    (all in one memory pool: one replays at a time), run as they are otherwise. ``compile``: the
    steps' layers run their width-independent work compiled (``talker_regions.py``); the prefills
    never do."""

    def __init__(self, talker, max_rows: int, capacity: int, capture: bool, compile: bool = False):
        weight = talker.codec_head.weight
        self.cache = SlotCache(talker.model.config, max_rows, capacity, weight.device, weight.dtype)
        size = sum(buffer.nbytes for buffer in (*self.cache.keys, *self.cache.values))
        logger.info("the talker's KV cache: %d rows of %d columns, %.2f GiB", max_rows, capacity, size / 2**30)
        sizes = [n for n in CAPTURED_ROWS if n < max_rows] + [max_rows]
        widths = _widths(SMALLEST_WIDTH, capacity)
        self.regions = regions = CompiledRegions.of(talker) if compile else None
        self.steps = {(rows, width): TalkerStep(talker, self.cache, rows, width, regions)
                      for rows in sizes for width in widths}
        self.prefills = {width: TalkerPrefill(talker, self.cache, width)
                         for width in _widths(min(SMALLEST_PREFILL, capacity), min(LARGEST_PREFILL, capacity))}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:  # all in one pool, the largest first (the others fit in it): one replays at a time
            pool = torch.cuda.graph_pool_handle()
            with torch.cuda.device(weight.device), compiling(compile):
                for width in sorted(self.prefills, reverse=True):
                    self.prefill_graphs[width] = captured(self.prefills[width].run, pool)
                for shape in sorted(self.steps, reverse=True):
                    self.graphs[shape] = captured(self.steps[shape].run, pool)
            self.cache.clear()  # the captures' runs wrote slot 0's columns and the padding slots' column 0

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A lone prompt (``embeds`` [length, hidden]; ``positions`` [3, length] where they are not its
        columns) prefilled into the next free slot: its last position's last-layer state [1, 1, hidden]
        and normed state [1, hidden]; None (nothing done) when no prefill width holds it."""
        length, slot = embeds.shape[0], self.cache.rows
        if slot >= self.cache.keys[0].shape[0]:
            raise RuntimeError(f"talker prefill into slot {slot} of a cache of {self.cache.keys[0].shape[0]}")
        width = min((w for w in self.prefills if w >= length), default=None)
        if width is None:
            return None
        prefill = self.prefills[width]
        prefill.embeds[0, :length].copy_(embeds)
        prefill.embeds[0, length:].zero_()
        prefill.positions[:, 0, :length].copy_(prefill.columns[:, :length] if positions is None else positions)
        prefill.layers.slot.fill_(slot)
        if width in self.prefill_graphs:
            self.prefill_graphs[width].replay()
        else:
            prefill.run()
        self.cache.writes[slot:slot + 1].fill_(length)  # (an index put of a host value would wait for the GPU)
        self.cache.lengths.append(length)
        return prefill.hidden[:, length - 1:length].clone(), prefill.last[:, length - 1].clone()

    @torch.inference_mode()
    def __call__(self, inputs: torch.Tensor, kept: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the running rows (``inputs`` [rows, 1, hidden], a row per slot): each
        row's last layer's state [rows, 1, hidden] and first codebook's logits [rows, vocab].
        ``kept``: the rows whose new position the cache keeps (all by default)."""
        rows, longest = inputs.shape[0], max(self.cache.lengths)
        if rows != self.cache.rows:
            raise RuntimeError(f"talker step of {rows} rows over a cache of {self.cache.rows}")
        if longest >= self.cache.capacity:
            raise RuntimeError(f"talker row at column {longest} of a cache of {self.cache.capacity}")
        shape = min((n, w) for n, w in self.steps if n >= rows and w > longest)
        step = self.steps[shape]
        step.inputs[:rows].copy_(inputs)
        if shape in self.graphs:
            self.graphs[shape].replay()
        else:
            step.run()
        self.cache.advance(kept)
        return step.hidden[:rows].clone(), step.logits[:rows].clone()

