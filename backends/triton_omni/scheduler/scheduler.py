"""The ``omni`` routing logic, in plain asyncio (the TensorRT-LLM ``Decoder``
half of its BLS split; ``triton_omni.triton.stages`` is the ``TritonDecoder``).

Routes come from the request, never from a flag in the code:

* ``modalities=["text"]``: ``ar`` streams text deltas;
* ``["image"]``: ``ar_encoder`` (prompt and negative prompt, one request)
  then ``diffusion`` (several images concurrently);
* ``enhance_prompt``: ``ar`` first rewrites the prompt for the image path
  (streamed as ``EnhancedPrompt`` deltas), then encode and diffuse;
* ``["text", "image"]``: both branches at once, merged into one stream;
* ``["audio"]`` (with ``"text"`` or without): the prompt in the model's chat
  template, ``ar`` (the thinker) streams the reply, and ``speech`` speaks
  it from its first token on (``Reply``: the tokens reach the talker as the
  thinker writes them), streaming audio chunks; the reply's text deltas are
  sent when ``"text"`` is asked for too. The stages overlap in time (the
  talker speaks while the thinker writes, the audio streams while the
  talker speaks), which an ensemble cannot express.

The scheduler yields events; the adapter turns them into responses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from triton_omni.scheduler.budget import EmbedsBudget
from triton_omni.scheduler.request import OmniRequest

# -- events ----------------------------------------------------------------------


@dataclass
class TextDelta:
    text: str
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)  # the new tokens' (asked for by the audio route)
    # on the first delta where asked for (the audio route of a prompt with audio or images): the prompt
    # as the thinker read it, its states at the audio and images, which the talker reads (whatever the
    # stages return; None where the thinker's states are asked for), and its rotary positions where it
    # has images (else None)
    heard: tuple[list[int], Any, Any] | None = None
    # where asked for (a talker that reads them: Qwen2.5-Omni's): the thinker's states of the positions
    # it read since the previous delta, [positions, width] (the prompt's on the first)
    states: Any = None


@dataclass
class EnhancedPrompt:
    text: str  # a delta of the rewrite while streaming; the whole prompt when done
    done: bool = False


@dataclass
class Progress:
    stage: str  # "encode" | "diffusion"
    step: int
    total: int
    image_index: int = 0


@dataclass
class ImageResult:
    index: int
    image: Any  # whatever the stages adapter returns (there: a Triton tensor, an image or a video's frames)
    fps: float | None = None  # a video's frame rate; None for an image


@dataclass
class AudioChunk:
    audio: Any  # the next samples of the spoken reply (whatever the stages adapter returns)
    codes: Any  # the codec frames those samples end, [codebooks, frames]
    sample_rate: int


Event = TextDelta | EnhancedPrompt | Progress | ImageResult | AudioChunk


class Reply:
    """The thinker's reply as it is written: its token ids so far, the thinker's states where they
    are asked for, and whether it has ended."""

    def __init__(self):
        self.ids: list[int] = []
        self.states: list[Any] = []  # a delta's states each (a talker that reads them)
        self.ended = False
        self._changed = asyncio.Event()

    def add(self, token_ids: list[int], states: Any = None) -> None:
        self.ids += token_ids
        if states is not None:
            self.states.append(states)
        self._changed.set()

    def end(self) -> None:
        self.ended = True
        self._changed.set()

    async def started(self, tokens: int = 1) -> None:
        """Once the reply has ``tokens`` tokens, or has ended."""
        while not (len(self.ids) >= tokens or self.ended):
            await self._wait()

    async def changes(self, sent: int = 0, sent_states: int = 0) -> AsyncIterator[tuple[list[int], list[Any]]]:
        """The token ids past the first ``sent`` and the states past the first ``sent_states``
        deltas' (``Reply.states``), as they are added, until the reply ends."""
        while True:
            if sent < len(self.ids) or sent_states < len(self.states):
                new, sent = self.ids[sent:], len(self.ids)
                states, sent_states = self.states[sent_states:], len(self.states)
                yield new, states
            elif self.ended:
                return
            else:
                await self._wait()

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()


# -- what the scheduler needs from the stages --------------------------------------


class Embeds(Protocol):
    nbytes: int


class Stages(Protocol):
    # the speaking model's talker reads the thinker's states at every token (Qwen2.5-Omni's)
    speaks_from_states: bool

    def generate(self, prompt: str, options: dict[str, Any], token_ids: bool = False, audio: list[bytes] = (),
                 heard: bool = False, states: bool = False, images: list[bytes] = ()) -> AsyncIterator[TextDelta]:
        """``audio``: the files the prompt's audio markers stand for; ``heard``: the first delta
        carries the thinker's states at them (``TextDelta.heard``); ``states``: each delta the
        thinker's states of the positions it read since the one before (``TextDelta.states``);
        ``images``: the files the prompt's image markers stand for."""
        ...

    def chat_prompt(self, prompt: str, clips: int = 0, images: int = 0) -> str:
        """``prompt`` as the speaking model's user turn (after ``clips`` audio parts and ``images``
        image parts), in its chat template, ready for its reply."""
        ...

    def speak(self, prompt: str, reply: Reply, options: dict[str, Any],
              heard: tuple[list[int], Any, Any] | None = None) -> AsyncIterator[AudioChunk]:
        """``reply`` spoken from its first token on (it is still being written); ``heard``: a
        prompt with audio or images as the thinker read it, its states there (or None, where the
        reply's ``states`` hold the thinker's states) and its rotary positions (None without images)."""
        ...

    async def encode(self, prompt: str, negative_prompt: str | None, images: list[bytes]) -> tuple[Embeds, Embeds]:
        """The prompt's embeddings and its negative side's (``negative_prompt`` None: absent);
        ``images``: input image files, which an edit family's encoder reads with the prompt."""
        ...

    async def diffuse(self, embeds: Embeds, negative: Embeds | None, options: dict[str, Any],
                      on_step: Callable[[int, int], None]) -> tuple[Any, float | None]:
        """The diffusion model's answer: an image, or a video's frames and their frame rate."""
        ...


@dataclass(frozen=True)
class EnhanceConfig:
    template: str = "Describe an image of {prompt} in vivid visual detail:"
    max_tokens: int = 32


class OmniScheduler:
    def __init__(self, stages: Stages, budget: EmbedsBudget, enhance: EnhanceConfig | None = None):
        self.stages = stages
        self.budget = budget
        self.enhance = enhance or EnhanceConfig()

    async def run(self, request: OmniRequest) -> AsyncIterator[Event]:
        """Events in the order they happen; the first failing branch cancels
        the others and its exception is raised after the events before it."""
        events: asyncio.Queue = asyncio.Queue()
        done = object()

        async def branches() -> None:
            try:
                async with asyncio.TaskGroup() as group:
                    if request.wants_audio:  # the text too, where it is asked for
                        group.create_task(self._speech(request, events.put_nowait))
                    elif request.wants_text:
                        group.create_task(self._text(request, events.put_nowait))
                    if request.wants_image:
                        group.create_task(self._images(request, events.put_nowait))
            finally:
                events.put_nowait(done)

        task = asyncio.create_task(branches())
        try:
            while (event := await events.get()) is not done:
                yield event
            await task
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _text(self, request: OmniRequest, emit: Callable[[Event], None]) -> None:
        # a prompt with audio or images is a user turn of the model's template (their parts there)
        seen = request.seen
        prompt = self.stages.chat_prompt(request.prompt, len(request.audio), len(seen)) \
            if request.audio or seen else request.prompt
        async for delta in self.stages.generate(prompt, request.text_options, audio=request.audio, images=seen):
            emit(delta)

    async def _speech(self, request: OmniRequest, emit: Callable[[Event], None]) -> None:
        seen = request.seen
        prompt = self.stages.chat_prompt(request.prompt, len(request.audio), len(seen))
        reply = Reply()
        heard = None

        # a Qwen2.5-Omni talker reads the thinker's states at every position, the audio's and images' too
        # (zeros there of the layer-0 input); a Qwen3-Omni one reads a middle layer's at the audio and
        # images alone (``heard``, with the prompt's positions where it has images)
        states = self.stages.speaks_from_states
        perceives = bool(request.audio or seen)

        async def think() -> None:
            nonlocal heard
            async for delta in self.stages.generate(prompt, request.text_options, token_ids=True,
                                                    audio=request.audio, heard=perceives and not states,
                                                    states=states, images=seen):
                heard = heard or delta.heard  # on the first delta, before its tokens reach the talker
                reply.add(delta.token_ids, delta.states)
                if request.wants_text and (delta.text or delta.finish_reason):
                    emit(delta)
            reply.end()

        async def speak() -> None:
            # a talker reading states starts at the reply's second token: the first one's state comes with it
            await reply.started(2 if states else 1)
            async for chunk in self.stages.speak(prompt, reply, request.speech_options, heard):
                emit(chunk)

        async with asyncio.TaskGroup() as group:  # a failing thinker cancels the speech, and the other way
            group.create_task(think())
            group.create_task(speak())

    async def _images(self, request: OmniRequest, emit: Callable[[Event], None]) -> None:
        prompt = await self._enhanced(request, emit) if request.enhance_prompt else request.prompt
        # absent, "" and " " are three different negative prompts (the family's pipeline decides)
        embeds, negative_embeds = await self.stages.encode(prompt, request.image_options.get("negative_prompt"),
                                                           request.images)
        emit(Progress("encode", 1, 1))
        nbytes = embeds.nbytes + negative_embeds.nbytes
        async with self.budget.reserve(nbytes * request.num_images), asyncio.TaskGroup() as group:
            for index in range(request.num_images):
                options = {k: v for k, v in request.image_options_for(index).items() if k != "negative_prompt"}
                if request.images:  # diffusion decodes and checks them, naming a bad one
                    options["images"] = request.images
                group.create_task(self._image(index, embeds, negative_embeds, options, emit))

    async def _image(self, index: int, embeds, negative, options: dict[str, Any],
                     emit: Callable[[Event], None]) -> None:
        def on_step(step: int, total: int) -> None:
            emit(Progress("diffusion", step, total, index))

        image, fps = await self.stages.diffuse(embeds, negative, options, on_step)
        emit(ImageResult(index, image, fps))

    async def _enhanced(self, request: OmniRequest, emit: Callable[[Event], None]) -> str:
        """Greedy rewrite of the prompt by the AR model; an empty rewrite
        (possible with a small model) keeps the original prompt."""
        options = {"max_tokens": self.enhance.max_tokens, "temperature": 0.0}
        rewrite = ""
        async for delta in self.stages.generate(self.enhance.template.format(prompt=request.prompt), options):
            rewrite += delta.text
            emit(EnhancedPrompt(delta.text))
        prompt = rewrite.strip() or request.prompt
        emit(EnhancedPrompt(prompt, done=True))
        return prompt



def _first_error(error: BaseException) -> BaseException:
    """The first real exception inside (nested) task-group exception groups."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
