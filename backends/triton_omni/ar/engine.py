"""The interface both AR engines implement, and what they yield."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from triton_omni.ar.sampling import SamplingOptions

if TYPE_CHECKING:
    from triton_omni.ar.vision_prompt import VisionInputs


@dataclass(frozen=True)
class TokenLogprob:
    """One candidate at one position (vLLM's ``Logprob``)."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


@dataclass
class Delta:
    """What one completion (``index`` of the request's ``n``) produced since
    its previous delta.

    ``logprobs`` (one dict ``token id -> TokenLogprob`` per new token) and
    ``cumulative_logprob`` (of the whole completion so far) are set when the
    engine was asked for log probabilities. ``finish_reason`` is set on the
    completion's last delta only (``stop``, ``length`` or ``abort``).
    """

    text: str
    num_tokens: int
    finish_reason: str | None = None
    index: int = 0
    logprobs: list[dict[int, TokenLogprob]] | None = None
    cumulative_logprob: float | None = None
    token_ids: list[int] = field(default_factory=list)  # the new tokens'
    # on the first delta, where ``stream`` was asked for ``states_at``: the hidden states of a layer at
    # the prompt's positions asked for, [positions, hidden] (what Qwen3-Omni's talker reads of the
    # thinker at the prompt's audio)
    prompt_states: torch.Tensor | None = None
    # where ``stream`` was asked to ``keep_states``: the states of the positions the model read since
    # the previous delta (the prompt's on the first, then the token fed back before this delta's),
    # each its layer 0's input plus its last layer's output, [positions, hidden] float32 on the host
    states: torch.Tensor | None = None


class ArEngine(ABC):
    """An LLM engine driven from one asyncio loop (the runner's)."""

    hidden_size: int
    name: str
    max_num_seqs: int  # the most requests decoded together

    @abstractmethod
    def check(self, options: SamplingOptions, logprobs: int | None = None) -> None:
        """Raise ``RequestValidationError`` for options this engine cannot honour.

        Called on Triton's thread before the request reaches the engine, so a
        bad request fails at once and alone. ``logprobs``: as in ``stream``."""

    @abstractmethod
    async def stream(self, prompt_ids: list[int], options: SamplingOptions, request_id: str,
                     logprobs: int | None, on_delta: Callable[[Delta], None], lora: str | None = None,
                     prompt_embeds: torch.Tensor | None = None,
                     states_at: tuple[int, list[int]] | None = None, keep_states: bool = False,
                     states_input: torch.Tensor | None = None, vision: VisionInputs | None = None) -> None:
        """Generate (``lora``: with that adapter of the model's; ``prompt_embeds``: the prompt read as
        these embeddings ``[len(prompt_ids), hidden]``, not as its ids' own, as a prompt holding audio
        is; ``states_at``: (layer, positions), the prefill's hidden states of that layer (0: the
        embeddings) at those prompt positions handed on in the first delta's ``prompt_states``;
        ``keep_states``: every position's states handed on in the deltas' ``states``, the prompt's
        layer-0 input there ``states_input`` where given (``[len(prompt_ids), hidden]``: a Qwen2.5-Omni
        talker reads zeros at the audio) in place of the embeddings the model reads; both by an
        engine that can: ``check_states`` says; ``vision``: what the LM reads of a prompt's images beyond
        its embeddings, its multimodal rotary positions and deepstack features (by an engine that can:
        ``check_images`` says)), handing each delta to ``on_delta``
        on the loop's thread as it comes; return when the request is done (each completion's last
        delta carries its ``finish_reason``), raise its error otherwise.
        Cancelled, the engine forgets the request and calls ``on_delta`` no more.

        ``logprobs`` asks for log probabilities even when ``options`` does not
        (0: the sampled token's only), for the ``return_*logprob*`` outputs.

        A callback rather than an async iterator: under load an engine
        produces a delta for every running request at every step, and a
        callback called where the engine has it costs no task switch per delta."""

    def check_images(self, field: str) -> None:  # noqa: B027 - an engine that reads them needs no check
        """Raise ``RequestValidationError`` (naming the request's ``field``) where this engine cannot
        read a prompt with images (its multimodal rotary positions, its deepstack features)."""

    def check_states(self, field: str) -> None:  # noqa: B027 - an engine that keeps states needs no check
        """Raise ``RequestValidationError`` (naming the request's ``field``) where this engine cannot
        hand on hidden states."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop working on a request; a no-op when it has already finished."""

    @abstractmethod
    async def encode(self, batch: list[list[int]], layers: tuple[int, ...] = (-1,),
                     attended: list[int] | None = None, loras: list[str | None] | None = None) -> list[torch.Tensor]:
        """Hidden states ``[num_tokens, len(layers) * hidden]`` of each prompt (``loras``: each with
        its adapter, or None), the states of
        ``layers`` (-1: the last) joined per token, layer after layer. ``attended``: how many of each
        prompt's leading tokens the model attends to; the rest is padding whose states are returned
        too (a pipeline that pads to a fixed length conditions on them). None: every token."""

    async def shutdown(self) -> None:  # noqa: B027 - engines without resources need nothing
        """Release engine resources (processes, threads, device memory)."""
