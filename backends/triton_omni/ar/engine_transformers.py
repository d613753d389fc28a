"""The transformers engine: ``generate`` with a streamer, on one worker thread.

Generation runs on a single worker thread so that the asyncio loop never
blocks, GPU work is serialised, and ``torch.manual_seed`` before a seeded
request makes its sampling reproducible. Cancellation and stop strings end a
``generate`` call through a stopping criterion polled after every token.

It honours the sampling keys in ``TRANSFORMERS_KEYS``; ``check`` refuses any
other key set to a value that would change the result (``n > 1``,
penalties, logprobs, ...), naming the key and this engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from triton_omni.ar.engine import ArEngine, Delta
from triton_omni.ar.sampling import TRANSFORMERS_KEYS, SamplingOptions
from triton_omni.errors import RequestValidationError


class TransformersEngine(ArEngine):
    name = "transformers"

    def __init__(self, model: str, device: str, dtype: torch.dtype):
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(self.device).eval()
        self.hidden_size = self.model.config.hidden_size
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-ar-transformers")
        self._stop_events: dict[str, threading.Event] = {}

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
                       logprobs: int | None = None) -> AsyncIterator[Delta]:
        self.check(options, logprobs)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        stop_event = self._stop_events[request_id] = threading.Event()
        streamer = _DeltaStreamer(self.tokenizer, options, stop_event,
                                  emit=lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        job = loop.run_in_executor(self._worker, self._generate_blocking, prompt_ids, options, streamer, stop_event)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    break
        finally:
            stop_event.set()
            self._stop_events.pop(request_id, None)
            await job

    def _generate_blocking(self, prompt_ids, options, streamer, stop_event) -> None:
        try:
            if options.seed is not None:
                torch.manual_seed(options.seed)
            input_ids = torch.tensor([prompt_ids], device=self.device)
            with torch.inference_mode():
                self.model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    streamer=streamer,
                    stopping_criteria=StoppingCriteriaList([_EventCriterion(stop_event)]),
                    pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                    **_generate_kwargs(options, self._eos_ids()),
                )
        except BaseException as exc:  # handed to the awaiting coroutine, which re-raises it
            streamer.emit(exc)

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    async def abort(self, request_id: str) -> None:
        event = self._stop_events.get(request_id)
        if event is not None:
            event.set()

    async def encode(self, batch: list[list[int]]) -> list[torch.Tensor]:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._encode_blocking, batch)

    def _encode_blocking(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """One padded forward pass for the whole batch; right padding keeps
        each prompt's positions identical to an unbatched run."""
        lengths = [len(ids) for ids in batch]
        input_ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        with torch.inference_mode():
            out = self.model(input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                             output_hidden_states=True)
        last = out.hidden_states[-1]
        return [last[row, :length] for row, length in enumerate(lengths)]

    async def shutdown(self) -> None:
        for event in self._stop_events.values():
            event.set()
        self._worker.shutdown(wait=True)


def _generate_kwargs(options: SamplingOptions, eos_ids: list[int]) -> dict:
    sampled = options.temperature > 0
    kwargs = {
        "max_new_tokens": options.max_tokens,
        # ignore_eos: EOS is suppressed until max_tokens, which is what min_new_tokens does.
        "min_new_tokens": options.max_tokens if options.ignore_eos else options.min_tokens,
        "do_sample": sampled,
        "repetition_penalty": options.repetition_penalty,
    }
    if options.stop_token_ids:  # generation ends at the model's EOS or at any of these
        kwargs["eos_token_id"] = eos_ids + [t for t in options.stop_token_ids if t not in eos_ids]
    if sampled:
        kwargs |= {"temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k or None,
                   "min_p": options.min_p or None}
    return kwargs


class _EventCriterion(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _DeltaStreamer(BaseStreamer):
    """Turns the token stream of ``generate`` into text deltas.

    Text is decoded from all tokens so far (multi-byte characters split across
    tokens come out whole). While stop strings are configured, the last
    ``len(longest stop) - 1`` characters are held back so that a stop string
    split across tokens is never streamed.
    """

    def __init__(self, tokenizer, options: SamplingOptions, stop_event: threading.Event, emit):
        self.tokenizer = tokenizer
        self.options = options
        self.stop_event = stop_event
        self.emit = emit
        self.token_ids: list[int] = []
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finished = False
        self.prompt_seen = False
        self.hold_back = max((len(s) for s in options.stop), default=1) - 1

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        if self.finished:
            return
        self.token_ids.extend(value.reshape(-1).tolist())
        text = self._decode()
        cut, stop = min(((i, s) for s in self.options.stop if (i := text.find(s)) >= 0), default=(-1, ""))
        if cut >= 0:
            keep = len(stop) if self.options.include_stop_str_in_output else 0
            self._finish(text[:cut + keep], "stop")
            self.stop_event.set()
        elif not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            self._send(text[: max(self.sent_chars, len(text) - self.hold_back)], None)

    def end(self) -> None:
        if not self.finished:
            text = self._decode()
            if self.stop_event.is_set():
                reason = "abort"
            elif len(self.token_ids) >= self.options.max_tokens:
                reason = "length"
            else:
                reason = "stop"
            self._finish(text, reason)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=self.options.skip_special_tokens)

    def _finish(self, text: str, reason: str) -> None:
        self.finished = True
        self._send(text, reason)

    def _send(self, text: str, reason: str | None) -> None:
        delta = text[self.sent_chars:]
        if delta or reason is not None:
            self.sent_chars = len(text)
            new_tokens, self.sent_tokens = len(self.token_ids) - self.sent_tokens, len(self.token_ids)
            self.emit(Delta(delta, new_tokens, reason))
