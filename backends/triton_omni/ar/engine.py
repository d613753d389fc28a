"""The interface both AR engines implement, and what they yield."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from triton_omni.ar.request import SamplingOptions


@dataclass
class Delta:
    """New text since the previous delta of the same request.

    ``num_output_tokens`` is cumulative; ``finish_reason`` is set on the last
    delta only (``stop``, ``length`` or ``abort``).
    """

    text: str
    num_output_tokens: int
    finish_reason: str | None = None


class ArEngine(ABC):
    """An LLM engine driven from one asyncio loop (the runner's)."""

    hidden_size: int

    @abstractmethod
    def generate(self, prompt_ids: list[int], options: SamplingOptions, request_id: str) -> AsyncIterator[Delta]:
        """Stream deltas; the last one carries ``finish_reason``."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop working on a request; a no-op when it has already finished."""

    @abstractmethod
    async def encode(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """Last hidden states ``[num_tokens, hidden]`` for each prompt."""

    async def shutdown(self) -> None:  # noqa: B027 - engines without resources need nothing
        """Release engine resources (processes, threads, device memory)."""
