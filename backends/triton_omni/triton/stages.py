"""The stages, called through Triton (BLS): the ``TritonDecoder`` half of the
scheduler. Each call is one ``pb_utils.InferenceRequest`` to ``ar``,
``ar_encoder`` or ``diffusion``, so Triton batches the scheduler's requests
with everyone else's.

``InferenceRequest.exec`` blocks; it runs on a thread pool sized for many
requests in flight (asyncio's default executor has only cpu_count + 4
threads, which would cap concurrent sub-requests far below the batch sizes).
Embeddings and images stay Triton tensors from one stage to the next (through
DLPack: no copy, and on the GPU when the stages are).

A stage whose stub dies never answers the sub-requests it held (Triton 2.51
forgets them with the stub). While a call waits, it watches the stage's
restart count, which the launcher's supervisor raises as soon as it finds
the stub dead: the call then fails with UNAVAILABLE within a second or so,
instead of the client waiting for its own deadline. (The thread blocked in
that ``exec`` stays blocked: one of the pool's threads per lost request, a
daemon thread, so that it does not keep the stub from exiting.)
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from triton_omni_protocol import SPEECH_INPUTS, STATUS_NAMES, diffusion_inputs, parse_status

from triton_omni.aio import DaemonPool
from triton_omni.channel import (
    KEY_PARAMETER,
    PROGRESS_PARAMETER,
    REPLY_PARAMETER,
    Cancellations,
    ProgressListener,
    ReplyWriter,
    StageErrors,
    new_id,
    restart_count,
)
from triton_omni.errors import RequestValidationError, StageError
from triton_omni.scheduler import AudioChunk, Reply, TextDelta

_SCALAR_TYPES = {spec.name: spec.numpy_dtype for spec in diffusion_inputs() if spec.kind == "scalar"}
_SPEECH_TYPES = {spec.name: spec.numpy_dtype for spec in SPEECH_INPUTS if spec.kind == "scalar"}


# how long a cancelled stream's flag stays for its stage to see, at most, if its end never comes
DRAIN_WAIT_S = 30.0


class TritonEmbeds:
    """``prompt_embeds`` of ``ar_encoder``, ``[1, tokens, hidden]``, kept as a Triton tensor, and
    its ``pooled_prompt_embeds`` where the family reads one (FLUX.1)."""

    def __init__(self, tensor, pooled=None):
        self.tensor = tensor
        view = torch.from_dlpack(tensor.to_dlpack())
        self.nbytes = view.numel() * view.element_size()
        self.pooled = None
        if pooled is not None:
            pooled_view = torch.from_dlpack(pooled.to_dlpack())
            if pooled_view.numel():  # zero values: the family reads none
                self.pooled = pooled
                self.nbytes += pooled_view.numel() * pooled_view.element_size()

    def named(self, name: str):
        return pb_utils.Tensor.from_dlpack(name, self.tensor.to_dlpack())


class TritonStages:
    def __init__(self, ar_model: str, encoder_model: str, diffusion_model: str,
                 progress: ProgressListener, cancellations: Cancellations, max_threads: int = 256,
                 restart_poll_s: float = 0.5, speech_model: str = "speech", speech_checkpoint: str = ""):
        self.models = {"ar": ar_model, "encoder": encoder_model, "diffusion": diffusion_model,
                       "speech": speech_model}
        self.speech_checkpoint = speech_checkpoint
        self._chat_template = None
        self.restart_poll_s = restart_poll_s
        self.progress = progress
        self.cancellations = cancellations
        self.errors = StageErrors(cancellations.directory)
        self.pool = DaemonPool(max_threads, "omni-bls")

    @functools.cached_property
    def speaks_from_states(self) -> bool:
        """Whether the speaking model's talker reads the thinker's states at every token (Qwen2.5-Omni's)."""
        if not self.speech_checkpoint:
            return False
        from triton_omni.demo_models import resolve_model

        config = Path(resolve_model(self.speech_checkpoint)) / "config.json"
        return json.loads(config.read_text()).get("model_type") == "qwen2_5_omni"

    async def generate(self, prompt: str, options: dict[str, Any], token_ids: bool = False,
                       audio: list[bytes] = (), heard: bool = False, states: bool = False,
                       images: list[bytes] = ()) -> AsyncIterator[TextDelta]:
        key = new_id()
        inputs = [_text("text_input", prompt, batched=False), _bool("stream", True),
                  _bool("return_finish_reason", True), _bool("return_token_ids", token_ids),
                  _text("sampling_parameters", json.dumps(options), batched=False)]
        if audio:
            inputs.append(pb_utils.Tensor("input_audio", np.array(list(audio), dtype=np.object_)))
        if images:
            inputs.append(pb_utils.Tensor("images", np.array(list(images), dtype=np.object_)))
        if heard:
            inputs.append(_bool("return_heard_states", True))
        if states:
            inputs.append(_bool("return_thinker_states", True))
        request = pb_utils.InferenceRequest(
            model_name=self.models["ar"], inputs=inputs,
            requested_output_names=["text_output", "finish_reason", "token_ids"]
            + (["prompt_token_ids", "prompt_positions"] if heard or states else [])
            + (["heard_states"] if heard else [])
            + (["thinker_states"] if states else []),
            parameters={KEY_PARAMETER: key},
        )
        async for response in self._stream(key, self.models["ar"], request):
            text = pb_utils.get_output_tensor_by_name(response, "text_output")
            if text is None:
                continue  # the empty final response
            finish = pb_utils.get_output_tensor_by_name(response, "finish_reason")
            ids = pb_utils.get_output_tensor_by_name(response, "token_ids")
            delta = TextDelta(_string(text), _string(finish) if finish is not None else None,
                              ids.as_numpy().reshape(-1).tolist() if ids is not None else [])
            prompt_ids = pb_utils.get_output_tensor_by_name(response, "prompt_token_ids") if heard or states else None
            if prompt_ids is not None:  # on the first response
                perceived = pb_utils.get_output_tensor_by_name(response, "heard_states") if heard else None
                positions = pb_utils.get_output_tensor_by_name(response, "prompt_positions")
                delta.heard = (prompt_ids.as_numpy().reshape(-1).tolist(),
                               perceived.as_numpy() if perceived is not None else None,
                               positions.as_numpy() if positions is not None else None)
            thinker = pb_utils.get_output_tensor_by_name(response, "thinker_states") if states else None
            if thinker is not None:
                delta.states = thinker.as_numpy()
            # vLLM sends empty deltas for partial UTF-8 characters (their tokens still count)
            if delta.text or delta.finish_reason or delta.token_ids:
                yield delta

    def chat_prompt(self, prompt: str, clips: int = 0, images: int = 0) -> str:
        """The speaking model's chat template (read once), around ``prompt`` as the user's turn
        (after ``clips`` audio parts and ``images`` image parts)."""
        for field, count in (("input_audio", clips), ("images", images)):
            if not self.speech_checkpoint and count:
                raise RequestValidationError(field, "needs the chat template of a model that hears and sees: this "
                                             "server's omni names none (set omni's speech_checkpoint)", count)
        if not self.speech_checkpoint:
            raise RequestValidationError("modalities", "'audio' needs a model that speaks: this server's omni has "
                                         "no speech stage (serve a speech demo, or set omni's speech_checkpoint)",
                                         "audio")
        if self._chat_template is None:
            from triton_omni.demo_models import resolve_model
            from triton_omni.scheduler.chat import ChatTemplate

            self._chat_template = ChatTemplate.of_model(Path(resolve_model(self.speech_checkpoint)))
        content = [*[{"type": "audio"}] * clips, *[{"type": "image"}] * images, {"type": "text", "text": prompt}] \
            if clips or images else prompt
        return self._chat_template.render([{"role": "user", "content": content}])

    async def speak(self, prompt: str, reply: Reply, options: dict[str, Any],
                    heard: tuple[list[int], np.ndarray | None, np.ndarray | None] | None = None
                    ) -> AsyncIterator[AudioChunk]:
        """The reply spoken by ``speech``, chunk by chunk as it streams them. The request carries the
        reply's tokens so far; while it is still being written, the rest follow through a
        ``ReplyWriter`` (``omni_reply``), which the talker reads as it needs them. ``heard``: a
        prompt with audio or images as the thinker read it, its states there and, with images, its
        rotary positions (``ar``'s)."""
        key = new_id()
        model = self.models["speech"]
        inputs = [_text("text_input", prompt, batched=False),
                  pb_utils.Tensor("reply_ids", np.array(reply.ids, dtype=np.int64))]
        if heard is not None:
            inputs.append(pb_utils.Tensor("prompt_ids", np.array(heard[0], dtype=np.int64)))
            if heard[1] is not None:
                inputs.append(pb_utils.Tensor("heard_states", np.ascontiguousarray(heard[1], dtype=np.float32)))
            if heard[2] is not None:
                inputs.append(pb_utils.Tensor("prompt_positions", np.ascontiguousarray(heard[2], dtype=np.int64)))
        # the reply's tokens and the thinker's states with them, taken together: rows for the prompt and
        # each token so far but the last (the speech stage checks the count)
        sent_ids, sent_states = len(reply.ids), len(reply.states)
        if self.speaks_from_states:
            inputs.append(pb_utils.Tensor("thinker_states", np.ascontiguousarray(
                np.concatenate(reply.states), dtype=np.float32)))
        inputs += [_text(name, value, batched=False) if isinstance(value, str)
                   else pb_utils.Tensor(name, np.array([value], dtype=_SPEECH_TYPES[name]))
                   for name, value in options.items()]
        parameters = {KEY_PARAMETER: key}
        writer = None if reply.ended else ReplyWriter(states=self.speaks_from_states)
        if writer is not None:
            parameters[REPLY_PARAMETER] = writer.name
        feeding = None
        try:
            request = pb_utils.InferenceRequest(model_name=model, inputs=inputs,
                                                requested_output_names=["audio", "codes", "sample_rate"],
                                                parameters=parameters)
            if writer is not None:
                feeding = asyncio.create_task(_feed(reply, sent_ids, sent_states, writer))
            async for response in self._stream(key, model, request):
                audio = pb_utils.get_output_tensor_by_name(response, "audio")
                if audio is None or audio.as_numpy().size == 0:
                    continue  # the empty final response, or a last chunk whose frames were all sent
                rate = int(pb_utils.get_output_tensor_by_name(response, "sample_rate").as_numpy().reshape(-1)[0])
                yield AudioChunk(audio, pb_utils.get_output_tensor_by_name(response, "codes"), rate)
        finally:
            if feeding is not None:
                feeding.cancel()
                await asyncio.gather(feeding, return_exceptions=True)
            if writer is not None:
                writer.remove()  # "abort" first, unless the reply ended

    async def encode(self, prompt: str, negative_prompt: str | None,
                     images: list[bytes]) -> tuple[TritonEmbeds, TritonEmbeds]:
        """The prompt's embeddings and its negative side's, in one ``ar_encoder`` request; an
        absent negative prompt is left out, and the encoder answers what the family's pipeline
        uses without one (zero tokens: none). Input image files go along: an edit family's
        encoder reads them with the prompt (the others' leave them to diffusion)."""
        key = new_id()
        inputs = [_text("text_input", prompt, batched=True)]
        if negative_prompt is not None:
            inputs.append(_text("negative_prompt", negative_prompt, batched=True))
        if images:
            inputs.append(pb_utils.Tensor("images", np.array([images], dtype=np.object_)))
        request = pb_utils.InferenceRequest(
            model_name=self.models["encoder"], inputs=inputs,
            requested_output_names=["prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds"],
            parameters={KEY_PARAMETER: key},
        )
        response = await self._exec(key, self.models["encoder"], request.exec)
        _raise_if_error(self.models["encoder"], response)
        return (TritonEmbeds(pb_utils.get_output_tensor_by_name(response, "prompt_embeds"),
                             pb_utils.get_output_tensor_by_name(response, "pooled_prompt_embeds")),
                TritonEmbeds(pb_utils.get_output_tensor_by_name(response, "negative_prompt_embeds")))

    async def diffuse(self, embeds: TritonEmbeds, negative: TritonEmbeds | None, options: dict[str, Any],
                      on_step: Callable[[int, int], None]):
        """The image, ``[1, H, W, 3]`` as a Triton tensor, and None; or, from a video model, its frames
        ``[1, F, H, W, 3]`` and their frame rate. ``on_step`` gets each denoising step through the
        progress channel."""
        key = new_id()
        inputs = [embeds.named("prompt_embeds")]
        if embeds.pooled is not None:
            inputs.append(pb_utils.Tensor.from_dlpack("pooled_prompt_embeds", embeds.pooled.to_dlpack()))
        if negative is not None:
            inputs.append(negative.named("negative_prompt_embeds"))
        inputs += [pb_utils.Tensor(name, np.array([value], dtype=np.object_) if name == "images" else
                                   np.array([[value]], dtype=_SCALAR_TYPES[name]))
                   for name, value in options.items()]
        request = pb_utils.InferenceRequest(
            model_name=self.models["diffusion"], inputs=inputs, requested_output_names=["image", "video", "fps"],
            parameters={KEY_PARAMETER: key, PROGRESS_PARAMETER: self.progress.name},
        )
        self.progress.subscribe(key, on_step)
        try:
            response = await self._exec(key, self.models["diffusion"], request.exec)
        finally:
            self.progress.unsubscribe(key)
        _raise_if_error(self.models["diffusion"], response)
        video = pb_utils.get_output_tensor_by_name(response, "video")
        if video is None:
            return pb_utils.get_output_tensor_by_name(response, "image"), None
        return video, float(pb_utils.get_output_tensor_by_name(response, "fps").as_numpy().reshape(-1)[0])

    async def _stream(self, key: str, model: str, request) -> AsyncIterator[Any]:
        """A decoupled request's responses, each stage error raised (``StageError``); cancelled, the
        request is flagged until its stream ends (``_exec``), wherever the cancellation finds it:
        while the stream starts, while it waits for a response, or between two (the consumer gone,
        this generator closed at its ``yield``). A stream left unread would leave the stage
        speaking on, and its last error recorded for nobody (``StageErrors``)."""
        restarts = restart_count(model)  # read once per stream, not once per response
        responses = iter(await self._exec(key, model, lambda: request.exec(decoupled=True), restarts,
                                          rest=lambda started: _drain(iter(started))))
        between = False  # suspended at the yield: its consumer may close it there
        try:
            while (response := await self._exec(key, model, lambda: next(responses, None), restarts,
                                                rest=lambda last: _drain(responses, last))) is not None:
                _raise_if_error(model, response)
                between = True
                yield response
                between = False
        finally:
            if between:
                self.cancellations.cancel(key)
                self._drain_then_forget(key, lambda: _drain(responses))
        if (message := self.errors.take(key)) is not None:  # an error the stage could not send through BLS
            raise _stage_error(model, message)

    async def _exec(self, key: str, model: str, call: Callable[[], Any], restarts: int | None = None,
                    rest: Callable[[Any], None] | None = None) -> Any:
        """Run a blocking BLS call to ``model``. If the caller is cancelled
        meanwhile, the downstream request is flagged cancelled; the flag is
        removed once the call has returned, and, for a stream (``rest``: read
        the stream's remaining responses, given what the call returned), once
        the stream has ended: its next response may come before the stage has
        seen the flag. If
        ``model`` restarts meanwhile (its count moves from ``restarts``, read
        now if not given), the call fails with UNAVAILABLE: its answer will
        never come."""
        future = asyncio.get_running_loop().run_in_executor(self.pool, call)
        restarts = restart_count(model) if restarts is None else restarts
        try:
            while not (await asyncio.wait({future}, timeout=self.restart_poll_s))[0]:
                if restart_count(model) != restarts:
                    raise StageError(model, "UNAVAILABLE", "its stub died while serving this request; the "
                                     "supervisor is restarting it: retry shortly")
            return future.result()
        except asyncio.CancelledError:
            self.cancellations.cancel(key)

            def settle(done) -> None:
                if done.cancelled() or done.exception() is not None or rest is None:
                    self._forget(key)
                else:
                    self._drain_then_forget(key, lambda: rest(done.result()))

            future.add_done_callback(settle)
            raise

    def _drain_then_forget(self, key: str, drain: Callable[[], None]) -> None:
        """A cancelled stream read to its end (``drain``), then forgotten; on a thread of its own, not
        the pool's: a stream whose end never comes (a stage that dies; before StageErrors, every
        stage's CANCELLED, which Triton 2.51's BLS lost) would hold a pool thread for good. Its
        flag and error go after ``DRAIN_WAIT_S`` all the same."""
        threading.Thread(target=lambda: (drain(), self._forget(key)), name="omni-bls-drain", daemon=True).start()
        timer = threading.Timer(DRAIN_WAIT_S, self._forget, (key,))
        timer.daemon = True
        timer.start()

    def _forget(self, key: str) -> None:
        """A cancelled call is over: its cancel flag, and the error its stage recorded (its CANCELLED), go."""
        self.cancellations.forget(key)
        self.errors.take(key)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _raise_if_error(model: str, response) -> None:
    """A failed sub-request becomes a ``StageError`` with the stage's status:
    read from the message's tag (BLS responses of Triton 2.51 lose the
    error code), else from the code, else INTERNAL."""
    if not response.has_error():
        return
    error = response.error()
    raise _stage_error(model, error.message(), getattr(error, "code", lambda: None)())


def _stage_error(model: str, tagged: str, code: int | None = None) -> StageError:
    status, message = parse_status(tagged)
    if status is None:
        status = next((n for n in STATUS_NAMES if getattr(pb_utils.TritonError, n, None) == code), "INTERNAL")
    return StageError(model, status, message)


async def _feed(reply: Reply, sent: int, sent_states: int, writer: ReplyWriter) -> None:
    """The reply's tokens past the first ``sent`` (and its states past the first ``sent_states``
    deltas') to ``writer`` as they come, then its end."""
    async for ids, states in reply.changes(sent, sent_states):
        writer.add(ids, np.concatenate(states) if states else None)
    writer.end()


def _drain(responses, last: Any = ...) -> None:
    """Read a cancelled stream to its end (its last response: the stage's final flag, its CANCELLED
    recorded in ``StageErrors``), unless the call that was under way when it was cancelled
    (``last``: what it returned) had read that end already: None (the stream had ended) or an
    error (a stage's error as its stream's first response is its last: reading on would wait
    forever)."""
    if last is None or (last is not ... and last.has_error()):
        return
    for _ in responses:
        pass


def _text(name: str, value: str, batched: bool):
    array = np.array([value.encode("utf-8")], dtype=np.object_)
    return pb_utils.Tensor(name, array[None] if batched else array)


def _bool(name: str, value: bool):
    return pb_utils.Tensor(name, np.array([value], dtype=np.bool_))


def _string(tensor) -> str:
    return b"".join(tensor.as_numpy().reshape(-1)).decode("utf-8")
