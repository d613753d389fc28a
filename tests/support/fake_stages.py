"""Scripted stages for unit tests of the ``omni`` scheduler (the ``Stages``
protocol without Triton): each call is recorded, text comes in fixed
deltas, diffusion reports every step, and any stage can be made to fail or
to hang until cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from triton_omni.scheduler import AudioChunk, Reply, TextDelta


@dataclass
class FakeEmbeds:
    prompt: str
    nbytes: int = 1000


@dataclass
class FakeStages:
    words: tuple[str, ...] = ("once ", "upon ", "a time")
    steps: int = 3
    fail: dict[str, Exception] = field(default_factory=dict)  # stage -> what it raises
    hang: set[str] = field(default_factory=set)  # stages that wait until cancelled
    calls: list[tuple[str, Any]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    replies: list[list[int]] = field(default_factory=list)  # the whole reply each speak call read
    speaks_from_states: bool = False  # a talker that reads the thinker's states (Qwen2.5-Omni's)
    spoken_states: list[list[Any]] = field(default_factory=list)  # the states each speak call read

    async def _enter(self, stage: str, argument: Any) -> None:
        self.calls.append((stage, argument))
        if stage in self.fail:
            raise self.fail[stage]
        if stage in self.hang:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.append(stage)
                raise

    async def generate(self, prompt: str, options: dict[str, Any], token_ids: bool = False,
                       audio: list[bytes] = (), heard: bool = False, states: bool = False,
                       images: list[bytes] = ()) -> AsyncIterator[TextDelta]:
        await self._enter("generate", (prompt, options) + ((list(audio), heard),) * bool(audio or heard)
                          + (("states",),) * states + (("images", list(images)),) * bool(images))
        for i, word in enumerate(self.words):
            await asyncio.sleep(0)
            yield TextDelta(word, "length" if i == len(self.words) - 1 else None, [i] if token_ids else [],
                            heard=(["heard"], f"states of {len(audio)} clips",
                                   f"positions of {len(images)} images" if images else None) if heard and i == 0
                            else None,
                            states=("prompt" if i == 0 else f"token {i - 1}") if states else None)

    def chat_prompt(self, prompt: str, clips: int = 0, images: int = 0) -> str:
        return f"<user>{'<audio>' * clips}{'<image>' * images}{prompt}<assistant>"

    async def speak(self, prompt: str, reply: Reply, options: dict[str, Any],
                    heard: tuple[list[int], Any, Any] | None = None) -> AsyncIterator[AudioChunk]:
        """Records the reply's tokens there at the call (``calls``) and the whole reply (``replies``)."""
        await self._enter("speak", (prompt, list(reply.ids), options) + (heard,) * (heard is not None))
        async for _ in reply.changes(len(reply.ids), len(reply.states)):
            pass
        self.replies.append(list(reply.ids))
        self.spoken_states.append(list(reply.states))
        for chunk in range(self.steps):
            await asyncio.sleep(0)
            yield AudioChunk(f"samples {chunk}", f"codes {chunk}", 24000)

    async def encode(self, prompt: str, negative_prompt: str | None,
                     images: list[bytes]) -> tuple[FakeEmbeds, FakeEmbeds]:
        await self._enter("encode", (prompt, negative_prompt))
        return FakeEmbeds(prompt), FakeEmbeds("<absent>" if negative_prompt is None else negative_prompt)

    async def diffuse(self, embeds: FakeEmbeds, negative: FakeEmbeds | None, options: dict[str, Any],
                      on_step: Callable[[int, int], None]) -> tuple[str, float | None]:
        await self._enter("diffuse", (embeds.prompt, negative and negative.prompt, options))
        for step in range(1, self.steps + 1):
            await asyncio.sleep(0)
            on_step(step, self.steps)
        if "num_frames" in options:  # as a video model answers: frames and their rate
            return f"{options['num_frames']} frames of {embeds.prompt} seed {options.get('seed')}", 16.0
        return f"image of {embeds.prompt} seed {options.get('seed')}", None
