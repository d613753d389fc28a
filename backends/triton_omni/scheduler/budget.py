"""Admission: a budget on the bytes of prompt embeddings in flight.

Embeddings are held from the moment the encoder returns them until the
diffusion stage has used them. Many concurrent requests with long prompts
can hold a lot of (GPU) memory; the vLLM-Omni review found no bound at all.
Over budget, a request waits up to ``max_wait_s`` for others to finish
(``policy="wait"``) or is refused at once (``policy="reject"``); either way a
refusal is a ``RequestRejectedError`` (UNAVAILABLE) with reason
``embeds_budget``. A request larger than the whole budget is refused at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

from triton_omni.errors import RequestRejectedError

REASON = "embeds_budget"


@dataclass(frozen=True)
class BudgetConfig:
    max_bytes: int = 256 * 1024 * 1024
    policy: Literal["wait", "reject"] = "wait"
    max_wait_s: float = 30.0


class EmbedsBudget:
    def __init__(self, config: BudgetConfig, on_change: Callable[[int], None] | None = None):
        if config.policy not in ("wait", "reject"):
            raise ValueError(f"admission policy must be 'wait' or 'reject', got {config.policy!r}")
        self.config = config
        self.in_flight = 0
        self._on_change = on_change or (lambda in_flight: None)
        self._freed = asyncio.Condition()

    @asynccontextmanager
    async def reserve(self, nbytes: int) -> AsyncIterator[None]:
        await self._acquire(nbytes)
        try:
            yield
        finally:
            await self._release(nbytes)

    async def _acquire(self, nbytes: int) -> None:
        limit = self.config.max_bytes
        if nbytes > limit:
            raise RequestRejectedError(
                f"prompt embeddings of {nbytes} bytes exceed the admission budget of {limit} bytes", REASON)
        async with self._freed:
            if self.config.policy == "reject" or self.config.max_wait_s <= 0:
                fits = self._fits(nbytes)
            else:
                try:
                    fits = await asyncio.wait_for(self._freed.wait_for(lambda: self._fits(nbytes)),
                                                  self.config.max_wait_s)
                except TimeoutError:
                    fits = False
            if not fits:
                raise RequestRejectedError(
                    f"server busy: {self.in_flight} bytes of prompt embeddings in flight, {nbytes} more would "
                    f"exceed the admission budget of {limit} bytes; retry later", REASON)
            self.in_flight += nbytes
            self._on_change(self.in_flight)

    async def _release(self, nbytes: int) -> None:
        async with self._freed:
            self.in_flight -= nbytes
            self._on_change(self.in_flight)
            self._freed.notify_all()

    def _fits(self, nbytes: int) -> bool:
        return self.in_flight + nbytes <= self.config.max_bytes
