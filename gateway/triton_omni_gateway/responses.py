"""``/v1/responses``: OpenAI's Responses API on the text models, as ``client.responses.create``
calls it. ``input`` is text or messages, ``instructions`` the system turn; the reply is one output
message of ``output_text``, its status ``incomplete`` where ``max_output_tokens`` ended it.
Streamed, it comes as the API's typed events, in the order the ``openai`` SDK's stream helper
reads them: the response created and in progress, the message and its text part added, the text's
deltas, then each of them done and the response completed. Nothing is stored: a response is not
retrievable later, and ``previous_response_id`` is refused (send the conversation as ``input``).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from triton_omni_gateway.errors import OpenAIError
from triton_omni_gateway.requests import ResponsesRequest
from triton_omni_gateway.text import Delta


class Reply:
    """One response as it is made: its ids, its text so far, and its body at each stage."""

    def __init__(self, request: ResponsesRequest):
        self.request = request
        self.id, self.message_id = f"resp_{secrets.token_hex(12)}", f"msg_{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.text, self.reason, self.input_tokens, self.output_tokens = "", None, 0, 0

    def add(self, delta: Delta) -> str:
        """``delta``'s text (its one completion's), taken in."""
        text = delta.texts[0] if delta.texts else ""
        self.text += text
        self.output_tokens += delta.tokens[0] if delta.tokens else 0
        self.input_tokens = delta.prompt_tokens or self.input_tokens
        if delta.finish_reasons:
            self.reason = delta.finish_reasons[0]
        return text

    @property
    def status(self) -> str:
        return "incomplete" if self.reason == "length" else "completed"

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def message(self, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [self.part()] if status != "in_progress" else []}

    def body(self, status: str) -> dict[str, Any]:
        """The response object; ``in_progress``: before any output."""
        request, done = self.request, status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if done else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": request.model, "output": [self.message(status)] if done else [],
            "parallel_tool_calls": False, "previous_response_id": None, "store": False,
            "temperature": request.temperature, "top_p": request.top_p, "text": {"format": {"type": "text"}},
            "tool_choice": "none", "tools": [], "truncation": "disabled", "user": request.user, "metadata": {},
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens} if done else None,
        }


async def whole(request: ResponsesRequest, stream: AsyncIterator[Delta]) -> dict[str, Any]:
    reply = Reply(request)
    async for delta in stream:
        reply.add(delta)
    return reply.body(reply.status)


async def events(request: ResponsesRequest, stream: AsyncIterator[Delta]) -> AsyncIterator[str]:
    """The typed events, each as a server-sent event named by its type and numbered in order. An
    error after the first event is an ``error`` event (the status line has gone out already)."""
    reply, number = Reply(request), 0
    at = {"item_id": reply.message_id, "output_index": 0, "content_index": 0}

    def event(kind: str, **fields) -> str:
        nonlocal number
        body = {"type": kind, "sequence_number": number, **fields}
        number += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    yield event("response.created", response=reply.body("in_progress"))
    yield event("response.in_progress", response=reply.body("in_progress"))
    yield event("response.output_item.added", output_index=0, item=reply.message("in_progress"))
    yield event("response.content_part.added", **at, part={"type": "output_text", "text": "", "annotations": [],
                                                           "logprobs": []})
    try:
        async for delta in stream:
            if text := reply.add(delta):
                yield event("response.output_text.delta", **at, delta=text, logprobs=[])
    except OpenAIError as error:
        yield event("error", code=error.code, message=error.message, param=error.param)
        return
    yield event("response.output_text.done", **at, text=reply.text, logprobs=[])
    yield event("response.content_part.done", **at, part=reply.part())
    status = reply.status
    yield event("response.output_item.done", output_index=0, item=reply.message(status))
    yield event(f"response.{status}", response=reply.body(status))
