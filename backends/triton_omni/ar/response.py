"""From engine deltas to the responses of one ``ar`` request.

The semantics are those of Triton's vLLM backend:

* streaming: one response per delta; ``text_output`` and ``logprobs`` hold
  what is new, ``num_output_tokens`` counts the new tokens,
  ``cumulative_logprob`` is the running total; the last response (all ``n``
  completions done) is final and carries ``finish_reason``;
* not streaming: one final response with the whole text (the prompt first
  when the request includes it), all tokens and log probabilities.

Every field holds one entry per completion (``n`` of them), in index order.
Which fields reach the client is the adapter's business (the ``return_*``
inputs); this module is Triton-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from triton_omni.ar.engine import Delta, TokenLogprob


@dataclass
class ArResponse:
    texts: list[str]
    num_output_tokens: list[int]
    num_input_tokens: int
    cumulative_logprobs: list[float | None]
    logprobs: list[list[dict[int, TokenLogprob]] | None]
    finish_reasons: list[str] | None = None  # set on the final response only
    final: bool = False
    token_ids: list[list[int]] = field(default_factory=list)  # per completion, the new ones (streamed) or all
    # on the first response, where asked for (return_heard_states, return_thinker_states): the prompt's
    # token ids as the model read them (its audio and image markers widened), its states at the audio
    # and images (the talker's layer; None for return_thinker_states) and, where it has images, its
    # rotary positions [3, tokens]
    heard: tuple[list[int], torch.Tensor | None, torch.Tensor | None] | None = None
    # where asked for (return_thinker_states): the states of the positions read since the last response
    thinker_states: torch.Tensor | None = None

    def absorb(self, later: ArResponse) -> ArResponse:
        """This streamed response and the next one as one, in place (what a
        client would have read from the two, when the server is too busy to
        send both); returns this response. In place because under load every
        delta of a stream merges into the one waiting in the response queue,
        which owns it (responses.py): a new response per merge would cost
        the stub's GIL on every token."""
        for i, text in enumerate(later.texts):
            if text:
                self.texts[i] += text
            self.num_output_tokens[i] += later.num_output_tokens[i]
            if self.logprobs[i] is not None or later.logprobs[i] is not None:
                self.logprobs[i] = (self.logprobs[i] or []) + (later.logprobs[i] or [])
        if later.token_ids:
            self.token_ids = [ids + new for ids, new in zip(self.token_ids or [[]] * len(later.token_ids),
                                                            later.token_ids, strict=True)]
        self.heard = self.heard if self.heard is not None else later.heard
        if later.thinker_states is not None:
            self.thinker_states = later.thinker_states if self.thinker_states is None \
                else torch.cat([self.thinker_states, later.thinker_states])
        self.num_input_tokens = later.num_input_tokens
        self.cumulative_logprobs = later.cumulative_logprobs
        self.finish_reasons = later.finish_reasons
        self.final = later.final
        return self

    def then(self, later: ArResponse) -> ArResponse:
        """``absorb`` into a new response, leaving this one as it is."""
        copy = replace(self, texts=list(self.texts), num_output_tokens=list(self.num_output_tokens),
                       logprobs=list(self.logprobs), token_ids=list(self.token_ids))
        return copy.absorb(later)


@dataclass
class _Completion:
    """One completion's running state. Its text and log probabilities are
    kept only for a whole (not streamed) response: a stream sends each delta
    as it comes, and gathering them anyway copied the text so far at every
    token (quadratic in the length)."""

    whole: bool
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[dict[int, TokenLogprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, delta: Delta) -> None:
        self.num_tokens += delta.num_tokens
        if self.whole:
            self.texts.append(delta.text)
            self.token_ids += delta.token_ids
            if delta.logprobs is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(delta.logprobs)
        if delta.cumulative_logprob is not None:
            self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason or self.finish_reason


@dataclass
class ResponseAssembler:
    """Feed it deltas; it answers with the response each one makes, if any.

    Called once per token of every stream, on the stub's event loop, whose
    GIL bounds ``ar`` under load: how many completions are finished is
    counted as they finish, not recounted per delta."""

    n: int
    num_input_tokens: int
    stream: bool
    prompt: str = ""  # prepended to the whole text when not streaming
    completions: list[_Completion] = field(init=False)
    finished: int = field(init=False, default=0)  # completions with a finish reason

    def __post_init__(self):
        self.completions = [_Completion(whole=not self.stream) for _ in range(self.n)]

    @property
    def done(self) -> bool:
        return self.finished == self.n

    def add(self, delta: Delta) -> ArResponse | None:
        completion = self.completions[delta.index]
        was_finished = completion.finish_reason is not None
        completion.add(delta)
        if not was_finished and completion.finish_reason is not None:
            self.finished += 1
        if self.stream:
            return self._streamed(delta)
        return self._whole() if self.done else None

    def _streamed(self, delta: Delta) -> ArResponse:
        def per_index(value, empty):
            if self.n == 1:  # the common case
                return [value]
            return [value if i == delta.index else empty for i in range(self.n)]

        return ArResponse(
            texts=per_index(delta.text, ""),
            num_output_tokens=per_index(delta.num_tokens, 0),
            num_input_tokens=self.num_input_tokens,
            cumulative_logprobs=[c.cumulative_logprob for c in self.completions],
            logprobs=per_index(delta.logprobs, []),
            finish_reasons=self._finish_reasons(),
            final=self.done,
            token_ids=per_index(delta.token_ids, []),
        )

    def _whole(self) -> ArResponse:
        return ArResponse(
            texts=[self.prompt + c.text for c in self.completions],
            num_output_tokens=[c.num_tokens for c in self.completions],
            num_input_tokens=self.num_input_tokens,
            cumulative_logprobs=[c.cumulative_logprob for c in self.completions],
            logprobs=[c.logprobs for c in self.completions],
            finish_reasons=self._finish_reasons(),
            final=True,
            token_ids=[c.token_ids for c in self.completions],
        )

    def _finish_reasons(self) -> list[str] | None:
        return [c.finish_reason for c in self.completions] if self.done else None
