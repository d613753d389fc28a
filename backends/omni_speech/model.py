"""Python-based Triton backend ``omni_speech``: the speech stage (decoupled).

A thin adapter: tensors in -> ``SpeechRequest`` -> ``SpeechRunner.speak`` ->
one response per audio chunk, the last one final with its ``finish_reason``;
errors mapped in one place. A cancelled request (the client's, or the
``omni`` scheduler's flag) leaves the talker's step batch at its next step.
"""

from __future__ import annotations

import json
import logging
import time

import triton_omni.triton  # noqa: F401 - first: fixes the stub's locale before torch reads files
from triton_omni.channel import Cancellations, ReplyReader, run_dir
from triton_omni.errors import RequestValidationError
from triton_omni.speech.runner import SAMPLE_RATE, AudioChunk, SpeechRunner
from triton_omni.triton import speech_io
from triton_omni.triton.metrics import StageMetrics, release_model, report_restarts
from triton_omni.triton.params import reply_name, split_parameters
from triton_omni.triton.responses import ResponseThread
from triton_omni.triton.tensors import read_inputs
from triton_omni_protocol import SPEECH_INPUTS

logger = logging.getLogger("omni_speech")


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return speech_io.auto_complete(auto_complete_model_config)

    def initialize(self, args):
        self.model_name = args["model_name"]
        self.context = f"model '{self.model_name}'"
        config, self.placement = speech_io.runner_config(json.loads(args["model_config"]), args)
        self.runner = SpeechRunner(config)
        self.responses = ResponseThread()
        self.restarts = report_restarts(self.model_name)
        self.metrics = StageMetrics("speech", self.model_name, args["model_version"], submit=self.responses.call,
                                    device=self.placement.label)
        self.cancellations = Cancellations()

    def execute(self, requests):
        for request in requests:
            started = time.monotonic()
            sender = request.get_response_sender()
            try:
                _, key, _ = split_parameters(request)
                parsed = self.runner.parse(read_inputs(request, SPEECH_INPUTS))
                reply = _open_reply(reply_name(request), self.runner.states_width)
            except Exception as exc:
                self.responses.fail(sender, exc, self.context, self.metrics, started)
                continue
            self.runner.loop.submit(self._speak(parsed, reply, sender, key, started))
        return None

    async def _speak(self, request, reply: ReplyReader | None, sender, key: str | None, started: float) -> None:
        first = True

        def respond(chunk: AudioChunk) -> None:
            nonlocal first
            if first:
                self.metrics.time_to_first_audio.observe(time.monotonic() - started)
                for phase, seconds in (chunk.phases or {}).items():
                    self.metrics.first_audio_phases[phase].observe(seconds)
                first = False
            self.metrics.audio_seconds.increment(len(chunk.samples) / SAMPLE_RATE)
            self.responses.send(sender, speech_io.chunk_response(chunk, SAMPLE_RATE),
                                final=chunk.finish_reason is not None)

        async with self.responses.serving(sender, self.context, self.metrics, started,
                                          cancelled_elsewhere=lambda: self.cancellations.is_cancelled(key), key=key):
            await self.runner.speak(request, respond, reply)

    def finalize(self):
        self.runner.close()
        self.responses.stop()
        release_model(self)


def _open_reply(name: str | None, states_width: int | None) -> ReplyReader | None:
    """The rest of a reply the ``omni`` scheduler is still writing (its ``omni_reply``), if any, and
    the thinker's states beside it where the talker reads them (``states_width``)."""
    if name is None:
        return None
    try:
        return ReplyReader(name, states_width=states_width)
    except FileNotFoundError:
        if states_width and (run_dir(create=False) / f"{name}.reply").exists():
            raise RequestValidationError("omni_reply", "is written without the thinker's states this model's "
                                         "talker reads (is omni's speech_checkpoint this model's?)", name) from None
        raise RequestValidationError("omni_reply", "names no reply being written on this server", name) from None
