"""The transformers engine: continuous batching over a plain transformers model.

The fallback where vLLM is missing, and not a toy there: concurrent requests
are decoded together, one forward pass per step for all of them
(``batching.StepBatcher``), joining at the next step and leaving when done.
Each request keeps its own sampling options, its own seeded generator (so a
seeded request gives the same text alone or in company), its stop strings and
its cancellation.

It honours the sampling keys in ``TRANSFORMERS_KEYS``; ``check`` refuses any
other key set to a value that would change the result (``n > 1``, logprobs,
...), naming the key and this engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from triton_omni.ar.batching import Sequence, StepBatcher
from triton_omni.ar.engine import ArEngine, Delta
from triton_omni.ar.sampling import TRANSFORMERS_KEYS, SamplingOptions
from triton_omni.errors import RequestValidationError
from triton_omni.lora import Adapters, read_peft_adapter

if TYPE_CHECKING:
    from triton_omni.ar.vision_prompt import VisionInputs

DEFAULT_MAX_NUM_SEQS = 32  # rows decoded together; vLLM's name for the same bound


class TransformersEngine(ArEngine):
    name = "transformers"

    def __init__(self, model: str, device: str, dtype: torch.dtype, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 encoder: bool = False, adapters: dict[str, str] | None = None, max_loras: int = 4,
                 on_lora: Callable[[str, str], None] | None = None):
        """``encoder``: the model only encodes (``ar_encoder``): its base model, no LM head, no
        batcher; any text model transformers knows, the text encoders of diffusion pipelines too.
        ``adapters``: LoRA adapters (name -> PEFT folder) requests may name, ``max_loras`` of them on
        the device, requests with different ones decoded in one forward pass (``triton_omni.lora``)."""
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        load = AutoModel if encoder else AutoModelForCausalLM
        self.model = load.from_pretrained(model, dtype=dtype).to(self.device).eval()
        self.hidden_size = self.model.config.get_text_config().hidden_size
        self.adapters = Adapters(self.model, functools.partial(read_peft_adapter, self.model), adapters,
                                 max_loras, on_event=on_lora) if adapters else None
        rows = None if self.adapters is None else self.adapters.rows
        self.batcher = None if encoder else StepBatcher(self.model, self.device, max_num_seqs, rows)
        if not encoder:
            self.tokenizer = AutoTokenizer.from_pretrained(model)
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-ar-encode")
        self._sequences: dict[str, Sequence] = {}

    def check(self, options: SamplingOptions, logprobs: int | None = None) -> None:
        for key in options.changed_keys():
            if key not in TRANSFORMERS_KEYS:
                raise RequestValidationError(
                    key, f"is not supported by the transformers engine (engine 'vllm' supports it; this engine "
                    f"supports {', '.join(sorted(TRANSFORMERS_KEYS))})", getattr(options, key))
        if logprobs is not None:
            raise RequestValidationError(
                "return_logprobs", "log probabilities (return_logprobs, return_cumulative_logprob) are not "
                "supported by the transformers engine (engine 'vllm' supports them)", None, show_value=False)

    async def generate(self, prompt_ids: list[int], options: SamplingOptions, request_id: str,
                       logprobs: int | None = None, lora: str | None = None,
                       prompt_embeds: torch.Tensor | None = None,
                       states_at: tuple[int, list[int]] | None = None,
                       keep_states: bool = False, states_input: torch.Tensor | None = None,
                       vision: VisionInputs | None = None) -> AsyncIterator[Delta]:
        self.check(options, logprobs)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        sequence = Sequence(prompt_ids, options, self.tokenizer, self._eos_ids(),
                            emit=lambda item: loop.call_soon_threadsafe(queue.put_nowait, item),
                            prompt_embeds=prompt_embeds, states_at=states_at, keep_states=keep_states,
                            states_input=states_input, vision=vision)
        async with self._adapter(lora) as slot:
            sequence.lora = slot
            async for delta in self._run(sequence, request_id, queue):
                yield delta

    @contextlib.asynccontextmanager
    async def _adapter(self, lora: str | None):
        """The (slot, scale) of ``lora`` on the device, pinned while the request runs (None: none)."""
        if lora is None:
            yield None
            return
        slot = await asyncio.wrap_future(self.adapters.acquire(lora))
        try:
            yield slot, 1.0
        finally:
            self.adapters.release(slot)

    async def _run(self, sequence: Sequence, request_id: str, queue: asyncio.Queue) -> AsyncIterator[Delta]:
        self._sequences[request_id] = sequence
        self.batcher.submit(sequence)
        first = True
        try:
            while True:
                item = _coalesce(await queue.get(), queue)
                if isinstance(item, BaseException):
                    raise item
                if first:  # the prefill kept them before its first token went out; handed on, not held
                    item.prompt_states, sequence.prompt_states, first = sequence.prompt_states, None, False
                yield item
                if item.finish_reason is not None:
                    break
        finally:  # finished, failed, or the consumer went away: the row leaves at the next step
            sequence.cancel()
            self._sequences.pop(request_id, None)

    async def stream(self, prompt_ids: list[int], options: SamplingOptions, request_id: str,
                     logprobs: int | None, on_delta: Callable[[Delta], None], lora: str | None = None,
                     prompt_embeds: torch.Tensor | None = None,
                     states_at: tuple[int, list[int]] | None = None, keep_states: bool = False,
                     states_input: torch.Tensor | None = None, vision: VisionInputs | None = None) -> None:
        async for delta in self.generate(prompt_ids, options, request_id, logprobs, lora, prompt_embeds,
                                         states_at, keep_states, states_input, vision):
            on_delta(delta)

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    async def abort(self, request_id: str) -> None:
        sequence = self._sequences.get(request_id)
        if sequence is not None:
            sequence.cancel()

    async def encode(self, batch: list[list[int]], layers: tuple[int, ...] = (-1,),
                     attended: list[int] | None = None, loras: list[str | None] | None = None) -> list[torch.Tensor]:
        loras = loras or [None] * len(batch)
        async with contextlib.AsyncExitStack() as stack:
            slots = {lora: await stack.enter_async_context(self._adapter(lora)) for lora in set(loras)}
            return await asyncio.get_running_loop().run_in_executor(
                self._encoder, self._encode_blocking, batch, layers, attended, [slots[lora] for lora in loras])

    def _encode_blocking(self, batch: list[list[int]], layers: tuple[int, ...] = (-1,),
                         attended: list[int] | None = None, rows: list | None = None) -> list[torch.Tensor]:
        """One padded forward pass for the whole batch; right padding keeps
        each prompt's positions identical to an unbatched run."""
        lengths = [len(ids) for ids in batch]
        attended = lengths if attended is None else attended
        input_ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : attended[row]] = 1
        adapted = contextlib.nullcontext() if self.adapters is None else self.adapters.rows.bind(rows, self.device)
        with torch.inference_mode(), adapted:
            out = self.model(input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                             output_hidden_states=True)
        hidden = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)
        return [hidden[row, :length] for row, length in enumerate(lengths)]

    async def shutdown(self) -> None:
        if self.adapters is not None:
            self.adapters.close()
        if self.batcher is not None:
            self.batcher.stop()
        self._encoder.shutdown(wait=True)


def _coalesce(first: Delta | BaseException, queue: asyncio.Queue) -> Delta | BaseException:
    """``first`` merged with the deltas already waiting behind it.

    When the consumer falls behind (a busy server sending one response per
    token to many streams), it catches up with one response instead of many,
    as vLLM's DELTA outputs do."""
    merged = first
    while isinstance(merged, Delta) and merged.finish_reason is None and not queue.empty():
        following = queue.get_nowait()
        if isinstance(following, BaseException):
            return following
        merged = Delta(merged.text + following.text, merged.num_tokens + following.num_tokens,
                       following.finish_reason, token_ids=merged.token_ids + following.token_ids,
                       prompt_states=merged.prompt_states, states=_joined(merged.states, following.states))
    return merged


def _joined(first: torch.Tensor | None, then: torch.Tensor | None) -> torch.Tensor | None:
    return then if first is None else first if then is None else torch.cat([first, then])
