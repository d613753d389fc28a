"""``/v1/chat/completions`` and ``/v1/completions`` on the ``ar`` model.

Every request streams from Triton (one gRPC stream, the prompt never echoed
back): a streamed answer passes each delta on as a server-sent event, a
whole answer is the deltas joined. Sampling options go to the model as
vLLM's ``sampling_parameters``, so the model validates them and names any
value it refuses.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from triton_omni_gateway.errors import OpenAIError
from triton_omni_gateway.requests import ChatRequest, CompletionRequest
from triton_omni_gateway.triton import Triton, outputs

FINISH_REASONS = {"stop": "stop", "length": "length"}


@dataclass
class Choice:
    """What one completion (``index`` of ``n``) has produced so far."""

    text: str = ""
    tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Delta:
    """One response of the ``ar`` model, per completion: the new text and log probabilities."""

    texts: list[str]
    tokens: list[int]
    logprobs: list[list[dict] | None]
    finish_reasons: list[str] | None
    prompt_tokens: int | None
    token_ids: list[int] = field(default_factory=list)  # the new tokens' (asked for by a spoken reply)
    # a spoken reply to audio or images, on the first delta: the prompt as the thinker read it, its states
    # at the audio and images, and its rotary positions where it has images
    prompt_token_ids: list[int] = field(default_factory=list)
    heard_states: np.ndarray | None = None
    prompt_positions: np.ndarray | None = None
    # a spoken reply whose talker reads the thinker's states (Qwen2.5-Omni's): those of the positions the
    # thinker read since the previous delta (the prompt's on the first, with prompt_token_ids)
    thinker_states: np.ndarray | None = None


def ar_values(prompt: str, sampling: dict[str, Any], token_ids: bool = False,
              audio: list[bytes] | None = None, heard: bool = False, states: bool = False,
              images: list[bytes] | None = None) -> dict[str, Any]:
    """The ``ar`` model's inputs for one streamed request (``audio``: the files the prompt's audio
    markers stand for; ``heard``: the thinker's states at them asked for, which a talker reads;
    ``states``: its states at every position, which a Qwen2.5-Omni talker reads; ``images``: the
    image files the prompt's image markers stand for)."""
    return {"text_input": prompt, "stream": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(sampling), "return_finish_reason": True,
            "return_num_input_tokens": True, "return_num_output_tokens": True,
            "return_logprobs": "logprobs" in sampling, "return_token_ids": token_ids} \
        | ({"input_audio": audio} if audio else {}) | ({"return_heard_states": True} if heard else {}) \
        | ({"return_thinker_states": True} if states else {}) | ({"images": images} if images else {})


async def deltas(triton: Triton, model: str, prompt: str, sampling: dict[str, Any],
                 token_ids: bool = False, audio: list[bytes] | None = None,
                 heard: bool = False, states: bool = False, images: list[bytes] | None = None) -> AsyncIterator[Delta]:
    # The last response carries the finish reasons (of all `n` completions).
    finished = lambda result: any(o.name == "finish_reason" for o in result.get_response().outputs)  # noqa: E731
    # aclosing: closing this generator closes Triton's stream, which cancels the request in the model
    # (an `async for` left early does not close what it iterates)
    async with aclosing(triton.stream(model, ar_values(prompt, sampling, token_ids, audio, heard, states, images),
                                      finished)) as results:
        async for result in results:
            found = outputs(result)
            heard_states = result.as_numpy("heard_states") if "heard_states" in found else None
            thinker_states = result.as_numpy("thinker_states") if "thinker_states" in found else None
            positions = result.as_numpy("prompt_positions") if "prompt_positions" in found else None
            texts = found.get("text_output", [])
            logprobs = found.get("logprobs")
            yield Delta(texts=texts, tokens=found.get("num_output_tokens") or [0] * len(texts),
                        logprobs=[json.loads(v) for v in logprobs] if logprobs else [None] * len(texts),
                        finish_reasons=found.get("finish_reason"),
                        prompt_tokens=(found.get("num_input_tokens") or [0])[0],
                        token_ids=found.get("token_ids") or [],
                        prompt_token_ids=found.get("prompt_token_ids") or [], heard_states=heard_states,
                        thinker_states=thinker_states, prompt_positions=positions)


async def joined(streams: list[AsyncIterator[Delta]], n: int) -> AsyncIterator[Delta]:
    """Several prompts' streams of ``n`` completions each, as one stream of all their completions
    (prompt i's at ``i * n``), for ``/v1/completions`` with a list of prompts: each prompt is its own
    request to the model, and they run at once. Nothing passes on until every prompt has its first
    response, so that a prompt the model refuses makes the request's 4xx rather than an event after
    the others' text; then each delta passes on as it comes, with ``None`` as the finish reason of
    the choices it does not finish. Closing this closes every prompt's stream (their requests
    cancelled in the model)."""
    width, found = len(streams) * n, asyncio.Queue()
    prompt_tokens = [0] * len(streams)

    async def pump(index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async with aclosing(stream):
                async for delta in stream:
                    found.put_nowait((index, delta))
        except Exception as error:  # raised again where the deltas are read
            found.put_nowait((index, error))
        else:
            found.put_nowait((index, None))

    def widened(index: int, delta: Delta) -> Delta:
        """``delta`` (prompt ``index``'s ``n`` completions) in its place among all the completions."""
        def placed(values: list, empty: Any) -> list:
            return [empty] * (index * n) + (list(values) + [empty] * n)[:n] + [empty] * (width - (index + 1) * n)

        reasons = placed(delta.finish_reasons, None) if delta.finish_reasons else None
        return Delta(texts=placed(delta.texts, ""), tokens=placed(delta.tokens, 0),
                     logprobs=placed(delta.logprobs, None), finish_reasons=reasons, prompt_tokens=sum(prompt_tokens))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        held: list[tuple[int, Delta]] = []  # the first responses, until every prompt has one
        waiting, running = set(range(len(streams))), len(streams)
        while running:
            index, delta = await found.get()
            if isinstance(delta, Exception):
                raise delta
            if delta is None:  # that prompt's stream has ended
                running -= 1
            else:
                prompt_tokens[index] = delta.prompt_tokens or prompt_tokens[index]
                held.append((index, delta))
            waiting.discard(index)
            if not waiting:
                for place, each in held:
                    yield widened(place, each)
                held = []
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(c.tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


# -- log probabilities: the model's per-position candidates (the sampled token first) -> OpenAI's shapes

def _candidates(position: dict) -> list[tuple[str, float, int]]:
    return [(c["decoded_token"], c["logprob"], c["rank"]) for c in position.values()]


def chat_logprobs(positions: list[dict], top: int) -> list[dict]:
    def entry(token, logprob):
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    for position in positions:
        sampled, *_ = candidates = _candidates(position)
        ranked = sorted({(rank, token, lp) for token, lp, rank in candidates if rank <= top})
        content.append(entry(sampled[0], sampled[1]) | {"top_logprobs": [entry(t, lp) for _, t, lp in ranked]})
    return content


def completion_logprobs(positions: list[dict], top: int, offset: int) -> dict:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for position in positions:
        sampled, *_ = candidates = _candidates(position)
        tokens.append(sampled[0])
        token_logprobs.append(sampled[1])
        tops.append({token: lp for token, lp, rank in candidates if rank <= top} if top else None)
        offsets.append(offset)
        offset += len(sampled[0])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


# -- the two endpoints

@dataclass
class TextEndpoint:
    """What differs between chat and completions: the object names and a choice's shape."""

    object: str  # "chat.completion" | "text_completion"
    id_prefix: str
    whole_choice: Callable[[int, Choice], dict]
    chunk_choice: Callable[[int, str, list[dict] | None, str | None, bool], dict]


def _chat_whole(request: ChatRequest) -> Callable[[int, Choice], dict]:
    def choice(index: int, c: Choice) -> dict:
        logprobs = {"content": chat_logprobs(c.logprobs, request.top_logprobs or 0)} if request.logprobs else None
        return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                "finish_reason": c.finish_reason}
    return choice


def _chat_chunk(request: ChatRequest) -> Callable:
    def choice(index: int, text: str, positions, finish_reason, first_chunk: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first_chunk else ({"content": text} if text else {})
        logprobs = ({"content": chat_logprobs(positions or [], request.top_logprobs or 0)}
                    if request.logprobs and positions else None)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return choice


def _completion_whole(request: CompletionRequest) -> Callable[[int, Choice], dict]:
    def choice(index: int, c: Choice) -> dict:
        echo = request.prompt_of(index) if request.echo else ""
        logprobs = (completion_logprobs(c.logprobs, request.logprobs, len(echo))
                    if request.logprobs is not None else None)
        return {"index": index, "text": echo + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}
    return choice


def _completion_chunk(request: CompletionRequest) -> Callable:
    def choice(index: int, text: str, positions, finish_reason, first_chunk: bool) -> dict:
        if first_chunk and request.echo:
            text = request.prompt_of(index) + text
        logprobs = (completion_logprobs(positions or [], request.logprobs, 0)
                    if request.logprobs is not None and positions else None)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return choice


def chat_endpoint(request: ChatRequest) -> TextEndpoint:
    return TextEndpoint("chat.completion", "chatcmpl", _chat_whole(request), _chat_chunk(request))


def completion_endpoint(request: CompletionRequest) -> TextEndpoint:
    return TextEndpoint("text_completion", "cmpl", _completion_whole(request), _completion_chunk(request))


async def whole(endpoint: TextEndpoint, model: str, stream: AsyncIterator[Delta], n: int) -> dict:
    """Every delta joined into one response."""
    choices = [Choice() for _ in range(n)]
    prompt_tokens = 0
    async for delta in stream:
        prompt_tokens = delta.prompt_tokens or prompt_tokens
        for i, choice in enumerate(choices):
            choice.text += delta.texts[i]
            choice.tokens += delta.tokens[i]
            choice.logprobs += delta.logprobs[i] or []
        for i, reason in enumerate(delta.finish_reasons or []):
            if reason is not None:  # None: a choice of another prompt (``joined``), still running
                choices[i].finish_reason = FINISH_REASONS.get(reason, "stop")
    return {"id": f"{endpoint.id_prefix}-{uuid.uuid4().hex}", "object": endpoint.object, "created": int(time.time()),
            "model": model, "choices": [endpoint.whole_choice(i, c) for i, c in enumerate(choices)],
            "usage": usage(prompt_tokens, choices)}


async def events(endpoint: TextEndpoint, model: str, stream: AsyncIterator[Delta], n: int,
                 include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per delta and completion, a last chunk with every finish reason,
    the usage chunk when asked for, then ``[DONE]``. An error after the first event is sent as an event
    (the status line has gone out already)."""
    ident, created = f"{endpoint.id_prefix}-{uuid.uuid4().hex}", int(time.time())
    chunk_object = f"{endpoint.object}.chunk" if endpoint.object == "chat.completion" else endpoint.object

    def chunk(choices: list[dict], **extra) -> str:
        body = {"id": ident, "object": chunk_object, "created": created, "model": model, "choices": choices}
        body |= {"usage": None} if include_usage else {}
        return f"data: {json.dumps(body | extra)}\n\n"

    choices = [Choice() for _ in range(n)]
    started = [False] * n
    prompt_tokens = 0
    try:
        async for delta in stream:
            prompt_tokens = delta.prompt_tokens or prompt_tokens
            reasons = delta.finish_reasons or [None] * n
            for i in range(n):
                choices[i].tokens += delta.tokens[i]
                if delta.texts[i] or not started[i]:
                    yield chunk([endpoint.chunk_choice(i, delta.texts[i], delta.logprobs[i], None, not started[i])])
                    started[i] = True
            if delta.finish_reasons:
                yield chunk([endpoint.chunk_choice(i, "", None, FINISH_REASONS.get(r, "stop"), False)
                             for i, r in enumerate(reasons) if r is not None])
    except OpenAIError as error:
        yield f"data: {json.dumps(error.body())}\n\n"
    else:
        if include_usage:
            yield chunk([], usage=usage(prompt_tokens, choices))
    yield "data: [DONE]\n\n"
