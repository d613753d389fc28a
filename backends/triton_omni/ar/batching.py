"""Continuous batching for the transformers engine.

``StepBatcher`` owns the model on one worker thread and decodes every running
sequence with one forward pass per step. A new sequence is prefilled alone
(so its first token is exactly what it would be alone) and then joins the
running batch: the two KV caches are left-padded to the same length and
stacked, and the attention mask hides the padding. A sequence leaves when it
finishes or is cancelled; its row is dropped from the cache and the columns
that became padding for every row are trimmed.

Each sequence samples with its own options and its own ``torch.Generator``:
what it draws never depends on what it shares the step with, so a seeded
request gives the text it gives alone (the batched matmuls can differ from
the unbatched ones only in the last bits of a logit).

Works with models whose cache is transformers' ``DynamicCache`` of full
attention layers (Llama, Qwen2, Mistral without a sliding window, ...).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
from collections.abc import Callable

import numpy as np
import torch
from transformers import DynamicCache

from triton_omni import transfers
from triton_omni.ar.engine import Delta
from triton_omni.ar.sampling import SamplingOptions
from triton_omni.ar.vision_prompt import VisionInputs, mrope

logger = logging.getLogger(__name__)


class Sequence:
    """One request's state: its tokens, its generator, its text so far.

    Owned by the batcher's thread once submitted; ``cancel`` is the only
    method other threads call."""

    def __init__(self, prompt_ids: list[int], options: SamplingOptions, tokenizer, eos_ids: list[int],
                 emit: Callable[[Delta | BaseException], None], prompt_embeds: torch.Tensor | None = None,
                 states_at: tuple[int, list[int]] | None = None, keep_states: bool = False,
                 states_input: torch.Tensor | None = None, vision: VisionInputs | None = None):
        self.prompt_ids = prompt_ids
        self.prompt_embeds = prompt_embeds  # [prompt, hidden]: what the prefill reads in place of the ids
        self.states_at = states_at  # (layer, positions): the prefill's states to keep (ArEngine.stream)
        self.prompt_states: torch.Tensor | None = None  # kept by the prefill, on the host
        self.keep_states = keep_states  # every position's states, handed on with the deltas (ArEngine.stream)
        self.states_input = states_input  # [prompt, hidden]: the prompt's layer-0 input in those states
        self.new_states: list[torch.Tensor] = []  # kept since the last delta, on the host
        self.options = options
        self.output_ids: list[int] = []
        self.vision = vision  # what the prefill reads of the prompt's images beyond its embeddings, or None
        # of the next token fed to the model: a prompt with images shifts its reply's (VisionInputs.delta)
        self.position = len(prompt_ids) + (vision.delta if vision is not None else 0)
        # vLLM's rules: EOS ends a sequence unless ignore_eos; stop_token_ids always do;
        # both are suppressed until min_tokens are out.
        self.stop_ids = sorted(set(options.stop_token_ids) | (set() if options.ignore_eos else set(eos_ids)))
        self.generator: torch.Generator | None = None  # set by the batcher for seeded requests
        self.text = _TextStream(tokenizer, options, self._emit_delta)
        self.emit = emit
        self.lora: tuple[int, float] | None = None  # its LoRA adapter's (slot, scale) (triton_omni.lora)
        self.done = False
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _emit_delta(self, delta: Delta) -> None:
        if self.new_states:  # the states of the positions read since the last delta go with this one
            delta.states, self.new_states = torch.cat(self.new_states), []
        self.emit(delta)

    def accept(self, token: int) -> None:
        """Take the sampled token; finish on a stop token, a stop string or max_tokens."""
        self.output_ids.append(token)
        stop_token = token in self.stop_ids
        if self.text.add(self.output_ids, drop_last=stop_token and not self.options.include_stop_str_in_output):
            self.done = True  # a stop string: the text stream already sent the final delta
        elif stop_token:
            self.finish("stop")
        elif len(self.output_ids) >= self.options.max_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        if not self.done:
            self.done = True
            self.text.finish(reason)

    def fail(self, exc: BaseException) -> None:
        if not self.done:
            self.done = True
            self.emit(exc)


class ContinuousBatch:
    """The loop that continuous batching shares (the transformers engine's, the talker's): on its own
    thread, it admits the pending sequences (each prefilled alone, then stacked onto the running
    batch's ``PaddedCache``), steps the running ones together, and drops those that end. A failed step
    fails the sequences in it, not the loop. Subclasses give ``_join`` and ``_step`` (``_keep`` and
    ``_reset`` where they keep state of their own per row), and call ``_start`` once built; a sequence
    has ``options`` (its seed), ``generator``, ``cancelled``, ``fail``, ``finish``."""

    name = "omni-batch"

    def __init__(self, device: torch.device, max_num_seqs: int):
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.generator = torch.Generator(device=device)  # for unseeded sequences
        self.generator.seed()
        self._pending: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self.rows: list = []
        self._cache = PaddedCache()
        self.max_rows_seen = 0  # the most rows stepped together (tests read it)
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def submit(self, sequence) -> None:
        if sequence.options.seed is not None:
            sequence.generator = torch.Generator(device=self.device)
            sequence.generator.manual_seed(sequence.options.seed)
        with self._wake:
            if self._stopping:
                raise RuntimeError(f"{self.name} is shutting down")
            self._pending.append(sequence)
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._pending or self.rows or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    break
                joining = [self._pending.popleft()
                           for _ in range(min(len(self._pending), self.max_num_seqs - len(self.rows)))]
            try:
                with torch.inference_mode():
                    for sequence in joining:
                        if sequence.cancelled:
                            sequence.finish("abort")
                    if live := [sequence for sequence in joining if not sequence.cancelled]:
                        self._join_all(live)
                        self.max_rows_seen = max(self.max_rows_seen, len(self.rows))
                    self._leave()
                    if self.rows:
                        self._step()
                        self._leave()
            except BaseException as exc:  # a failed forward pass fails the sequences in it, not the loop
                logger.exception("%s: a step failed", self.name)
                for sequence in self.rows + joining:
                    sequence.fail(exc)
                self._reset()
        for sequence in self.rows + list(self._pending):
            sequence.finish("abort")

    def _join_all(self, sequences: list) -> None:
        """Admit the sequences that arrived since the last step (each prefilled alone, by default)."""
        for sequence in sequences:
            self._join(sequence)

    def _reset(self) -> None:
        """Forget every running row (after a failed step)."""
        self.rows = []
        self._cache.clear()

    def _leave(self) -> None:
        """Drop finished and cancelled rows, and the padding no row needs any more."""
        for sequence in self.rows:
            if sequence.cancelled:
                sequence.finish("abort")
        keep = [i for i, sequence in enumerate(self.rows) if not sequence.done]
        if len(keep) < len(self.rows):
            self._cache.keep(keep)
            self._keep(keep)
            self.rows = [self.rows[i] for i in keep]

    def _keep(self, rows: list[int]) -> None:
        """Keep a subclass's per-row state of these rows only (``_leave``)."""

    def _join(self, sequence) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError


class StepBatcher(ContinuousBatch):
    """Decodes the running sequences together, one step at a time, on its own thread."""

    name = "omni-ar-batcher"

    def __init__(self, model, device: torch.device, max_num_seqs: int, adapter_rows=None):
        """``adapter_rows``: the model's ``AdapterRows`` where it has LoRA adapters (each row its own)."""
        super().__init__(device, max_num_seqs)
        self.model = model
        self.adapter_rows = adapter_rows
        self._start()

    def _join(self, sequence: Sequence) -> None:
        """Prefill alone, sample the first token, and stack the cache onto the batch's."""
        cache = DynamicCache()
        if sequence.prompt_embeds is None:
            prompt = {"input_ids": torch.tensor([sequence.prompt_ids], device=self.device)}
        else:
            prompt = {"inputs_embeds": sequence.prompt_embeds.to(self.device)[None]}
        kept = sequence.states_at
        # the layer-0 input the thinker's states add at the prompt: where not given, what the prefill reads
        layer0 = prompt.get("inputs_embeds")
        if sequence.states_input is not None:
            layer0 = sequence.states_input.to(self.device)
        # the layer output kept for a talker is hooked before the deepstack features are added: transformers'
        # hidden_states record each decoder layer's output as it leaves the layer, without them
        with self._adapted([sequence]), _layer_output(self.model, kept[0] if kept else None) as states, \
                _thinker_states(self.model, sequence.keep_states, layer0) as thinker, \
                _seeing(self.model, sequence.vision):
            out = self.model(**prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        if kept is not None:
            sequence.prompt_states = states[0][0, kept[1]].float().cpu()
        if thinker is not None:
            sequence.new_states.append(thinker()[0].float().cpu())
        self._cache.add(cache, len(sequence.prompt_ids))
        self.rows.append(sequence)
        sequence.accept(sample(out.logits[:, -1], [sequence], self.generator)[0])

    def _step(self) -> None:
        rows = self.rows
        input_ids = torch.tensor([[s.output_ids[-1]] for s in rows], device=self.device)
        position_ids = torch.tensor([[s.position] for s in rows], device=self.device)
        mask = self._cache.extend()
        keeping = [i for i, s in enumerate(rows) if s.keep_states]
        with self._adapted(rows), _thinker_states(self.model, bool(keeping)) as thinker:
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                             past_key_values=self._cache.cache, use_cache=True)
        if keeping:  # the token each row was fed: its states, copied to the host in one go
            states = thinker()[to_device(keeping, torch.long, self.device), 0].float().cpu()
            for i, row_states in zip(keeping, states.unbind(0), strict=True):
                rows[i].new_states.append(row_states[None])
        for sequence, token in zip(rows, sample(out.logits[:, -1], rows, self.generator), strict=True):
            sequence.position += 1
            sequence.accept(token)

    def _adapted(self, rows: list[Sequence]) -> contextlib.AbstractContextManager:
        """Around a forward pass of ``rows``: each row with its adapter."""
        if self.adapter_rows is None:
            return contextlib.nullcontext()
        return self.adapter_rows.bind([sequence.lora for sequence in rows], self.device)


@contextlib.contextmanager
def _seeing(model, vision: VisionInputs | None):
    """Around a prefill of a prompt with images, read as the multimodal model reads it: the model's
    rotary embedding at ``vision``'s three sections (not at each token's index), and each deepstack
    feature added to its decoder layer's output at the images' tokens."""
    if vision is None:
        yield
        return
    rotary = model.model.rotary_emb
    plain = rotary.forward
    rotary.forward = lambda hidden, *_positions, **_named: mrope(plain, hidden, vision)
    layers = model.model.layers
    hooks = [layers[i].register_forward_hook(functools.partial(_add_at, vision.image_at, features))
             for i, features in enumerate(vision.deepstack)]
    try:
        yield
    finally:
        del rotary.forward
        for hook in hooks:
            hook.remove()


def _add_at(at: torch.Tensor, features: torch.Tensor, _module, _args, output):
    """A decoder layer's output with ``features`` added at the prompt positions ``at`` (one row)."""
    hidden = output[0] if isinstance(output, tuple) else output
    hidden = hidden.clone()
    hidden[0, at.to(hidden.device)] += features.to(hidden.device, hidden.dtype)
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


@contextlib.contextmanager
def _layer_output(model, layer: int | None):
    """Around a forward pass: a list that then holds what ``hidden_states[layer]`` would (the
    embeddings for 0, else the output of decoder layer ``layer - 1``), kept by a hook on that
    module alone: ``output_hidden_states`` would keep every layer's states of the whole prompt."""
    if layer is None:
        yield None
        return
    layers = model.model.layers
    if not 0 <= layer < len(layers):  # the last entry is the final norm's output: no module gives it alone
        raise ValueError(f"hidden state {layer} is not kept here (0 to {len(layers) - 1})")
    found: list[torch.Tensor] = []
    module = model.get_input_embeddings() if layer == 0 else layers[layer - 1]
    hook = module.register_forward_hook(
        lambda _module, _args, output: found.append(output[0] if isinstance(output, tuple) else output))
    try:
        yield found
    finally:
        hook.remove()


@contextlib.contextmanager
def _thinker_states(model, wanted: bool, inputs_embeds: torch.Tensor | None = None):
    """Around a forward pass: a callable that then gives each position's layer 0 input (the token's
    embedding, or ``inputs_embeds`` where the pass read those) plus its last layer's output (after
    the final norm), summed in the model's dtype [rows, positions, hidden]: what a Qwen2.5-Omni
    talker reads of its thinker. Kept by hooks on those two modules alone (None where not ``wanted``)."""
    if not wanted:
        yield None
        return
    found: dict[str, torch.Tensor] = {}
    if inputs_embeds is not None:
        found["input"] = inputs_embeds[None] if inputs_embeds.dim() == 2 else inputs_embeds
    hooks = [module.register_forward_hook(lambda _m, _a, output, name=name: found.__setitem__(name, output))
             for name, module in (("input", model.get_input_embeddings()), ("last", model.model.norm))
             if not (name == "input" and inputs_embeds is not None)]
    try:
        yield lambda: found["input"].to(found["last"].dtype) + found["last"]
    finally:
        for hook in hooks:
            hook.remove()


class PaddedCache:
    """The running rows' KV caches (transformers' ``DynamicCache`` of full attention
    layers) as one batch, left-padded to one length, the mask hiding the padding."""

    def __init__(self):
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, cache length]: 0 over left padding

    def clear(self) -> None:
        self.cache, self.mask = None, None

    def add(self, cache: DynamicCache, length: int) -> None:
        """Stack one more row: ``cache`` of one sequence of ``length`` positions."""
        self.add_rows(cache, torch.ones(1, length, dtype=torch.long, device=cache.layers[0].keys.device))

    def add_rows(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Stack more rows: ``cache`` of a batch of sequences, ``mask`` [rows, length] 0 over its left padding."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
            return
        have, length = self.mask.shape[1], mask.shape[1]
        if length < have:
            mask = _left_pad(cache, mask, have - length)
        elif length > have:
            self.mask = _left_pad(self.cache, self.mask, length - have)
        for layer, joining in zip(self.cache.layers, cache.layers, strict=True):
            layer.keys = torch.cat([layer.keys, joining.keys])
            layer.values = torch.cat([layer.values, joining.values])
        self.mask = torch.cat([self.mask, mask])

    def extend(self) -> torch.Tensor:
        """The mask of a step that adds one position to every row."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        return self.mask

    def keep(self, rows: list[int]) -> None:
        """Keep these rows, in this order, and trim the columns that are padding for all of them."""
        if not rows:
            self.clear()
            return
        index = torch.tensor(rows, device=self.mask.device)
        first = int(self.mask[index].any(dim=0).nonzero()[0])  # first column some row still needs
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        self.mask = self.mask.index_select(0, index)[:, first:]


def _left_pad(cache: DynamicCache, mask: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad ``cache`` in place by ``width`` positions; returns the padded mask."""
    for layer in cache.layers:
        b, h, _, d = layer.keys.shape
        layer.keys = torch.cat([layer.keys.new_zeros(b, h, width, d), layer.keys], dim=2)
        layer.values = torch.cat([layer.values.new_zeros(b, h, width, d), layer.values], dim=2)
    return torch.cat([mask.new_zeros(mask.shape[0], width), mask], dim=1)


# -- sampling --------------------------------------------------------------------------


def sample(logits: torch.Tensor, rows: list[Sequence], shared: torch.Generator) -> list[int]:
    """One token per row, each with its row's options (vLLM's order: penalties,
    min_tokens, then temperature, top-k, top-p, min-p) and its own generator."""
    return sample_on_device(logits, rows, shared).tolist()


def sample_on_device(logits: torch.Tensor, rows: list[Sequence], shared: torch.Generator) -> torch.Tensor:
    """``sample``'s tokens left on the logits' device: the host does not wait for the GPU, so a
    caller that feeds them to the next pass (the talker's code predictor, 15 draws a frame) queues
    that pass at once."""
    logits = logits.float()
    _penalise(logits, rows)
    sampled = [i for i, s in enumerate(rows) if s.options.temperature > 0]
    if len(sampled) == len(rows):
        return _sample_rows(logits, rows, shared)
    tokens = logits.argmax(dim=-1)
    if sampled:  # indexed by a tensor already on the device: a list index is copied there and waited for
        index = to_device(sampled, torch.long, logits.device)
        tokens[index] = _sample_rows(logits.index_select(0, index), [rows[i] for i in sampled], shared)
    return tokens


def _penalise(logits: torch.Tensor, rows: list[Sequence]) -> None:
    """Each row's repetition penalty on the tokens it has seen, then, below its ``min_tokens``, its
    stop tokens banned: for all rows at once, a read and a write of the indexed logits per penalty
    value (a row at a time, 64 rows took the talker's GPU step 12 ms of small kernels and copies).
    The penalty stays a Python number, as transformers' own processor has it: on a GPU, dividing
    by a number and by a tensor of it may round differently."""
    seen: dict[float, list[np.ndarray]] = {}
    for i, sequence in enumerate(rows):
        penalty = sequence.options.repetition_penalty
        if penalty != 1.0:
            tokens = np.unique(np.asarray([*sequence.prompt_ids, *sequence.output_ids], dtype=np.int64))
            seen.setdefault(penalty, []).append(np.stack([np.full_like(tokens, i), tokens]))
    for penalty, pairs in seen.items():
        row, token = to_device(np.concatenate(pairs, axis=1), torch.long, logits.device)
        scores = logits[row, token]
        logits[row, token] = torch.where(scores > 0, scores / penalty, scores * penalty)
    banned = [(i, token) for i, s in enumerate(rows) if len(s.output_ids) < s.options.min_tokens
              for token in s.stop_ids]
    if banned:
        row, token = to_device(np.asarray(banned, dtype=np.int64).T, torch.long, logits.device)
        logits[row, token] = float("-inf")


def _sample_rows(logits: torch.Tensor, rows: list[Sequence], shared: torch.Generator) -> torch.Tensor:
    device = logits.device
    vocab = logits.shape[-1]
    params = to_device(
        [[s.options.temperature, s.options.top_k or vocab, s.options.top_p, s.options.min_p] for s in rows],
        torch.float32, device)
    probs, order = filtered_probs(logits, params)
    return order.gather(1, _draws(probs, [s.generator or shared for s in rows])).squeeze(1)


def filtered_probs(logits: torch.Tensor, params: torch.Tensor, ranked: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities after its temperature, top-k, top-p and min-p (``params``' columns,
    one row of them per row of ``logits``), sorted from the most likely, and the order that sorted
    them. Tensor work only, so a CUDA graph may hold it (the talker's code predictor's).

    ``ranked``: no row's top-k is larger, so only that many are ranked (a ``topk`` in place of
    the whole vocabulary's sort) and the columns past it, which every row drops, are left out."""
    temperature, top_k, top_p, min_p = params.T
    scaled = logits / temperature[:, None]
    ordered, order = scaled.topk(ranked, dim=-1) if ranked else scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(ordered.shape[-1], device=logits.device)[None, :]
    # top-p over the top k's own distribution, as transformers' warpers and vLLM's sampler take it
    # (over the whole vocabulary's, a row with both keeps more tokens than they do)
    ordered = ordered.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs > top_p[:, None]) | (probs < min_p[:, None] * probs[:, :1])
    drop[:, 0] = False  # the most likely token always stays
    return ordered.masked_fill(drop, float("-inf")).softmax(dim=-1), order


def _draws(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Each row's ``torch.multinomial(probs[i], 1, generator=generators[i])``, the same draw from
    the same generator state (its one-sample path: the argmax of ``probs`` over exponential
    noise), without the two checks of ``probs`` it reads back to the host (on a GPU each is a
    sync, once per row and draw): each row's noise from its own generator, one argmax for all."""
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators, strict=True):
        row.exponential_(1, generator=generator)
    return (probs / noise).argmax(dim=-1, keepdim=True)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor of ``values`` on ``device``, copied without waiting for the work queued there
    (``torch.tensor(values, device=...)`` waits for the stream: a step's sampling would then sync
    the host with the GPU once per row); ``transfers.to_device``'s copy."""
    return transfers.to_device(torch.tensor(values, dtype=dtype), torch.device(device))


# -- text ------------------------------------------------------------------------------


class _TextStream:
    """Turns a sequence's tokens into text deltas.

    Every token makes a delta, with the text it completes: multi-byte
    characters split across tokens come out whole, so a token may complete
    none yet (its delta then has empty text). While stop strings are configured, the last
    ``len(longest stop) - 1`` characters are held back so that a stop string
    split across tokens is never streamed.
    """

    def __init__(self, tokenizer, options: SamplingOptions, emit: Callable[[Delta], None]):
        self.tokenizer = tokenizer
        self.options = options
        self.emit = emit
        self.text = ""
        self.num_tokens = 0
        self.sent_chars = 0
        self.sent_tokens = 0
        self.token_ids: list[int] = []
        self.hold_back = max((len(s) for s in options.stop), default=1) - 1

    def add(self, token_ids: list[int], drop_last: bool) -> bool:
        """Stream what is safe to send; True when a stop string ended the text (final delta sent)."""
        self.num_tokens = len(token_ids)
        self.token_ids = token_ids
        self.text = self.tokenizer.decode(token_ids[:-1] if drop_last else token_ids,
                                          skip_special_tokens=self.options.skip_special_tokens)
        cut, stop = min(((i, s) for s in self.options.stop if (i := self.text.find(s)) >= 0), default=(-1, ""))
        if cut >= 0:
            keep = len(stop) if self.options.include_stop_str_in_output else 0
            self.text = self.text[:cut + keep]
            self.finish("stop")
            return True
        if self.text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            self._send(self.text[: self.sent_chars], None)
        else:
            self._send(self.text[: max(self.sent_chars, len(self.text) - self.hold_back)], None)
        return False

    def finish(self, reason: str) -> None:
        self._send(self.text, reason)

    def _send(self, text: str, reason: str | None) -> None:
        delta = text[self.sent_chars:]
        # Every new token is reported, with the text it completes (maybe none yet), as vLLM does.
        if delta or reason is not None or self.num_tokens > self.sent_tokens:
            self.sent_chars = len(text)
            new_ids, self.sent_tokens = self.token_ids[self.sent_tokens:self.num_tokens], self.num_tokens
            self.emit(Delta(delta, len(new_ids), reason, token_ids=new_ids))
