"""Python-based Triton backend ``omni_scheduler``: the ``omni`` BLS model.

A thin adapter around the Triton-free ``OmniScheduler``: tensors in -> typed
``OmniRequest`` -> scheduler events -> responses. Each request runs as a task
on one event loop, so independent requests (and the sub-requests of one) are
in flight together. The response thread watches each request; a client's
cancellation cancels its task, which flags its downstream requests cancelled.
"""

from __future__ import annotations

import json
import time

import torch
import triton_omni.triton  # noqa: F401 - first: fixes the stub's locale before torch reads files
import triton_python_backend_utils as pb_utils
from triton_omni.aio import EventLoopThread
from triton_omni.channel import Cancellations, ProgressListener
from triton_omni.scheduler import (
    AudioChunk,
    EmbedsBudget,
    EnhancedPrompt,
    ImageResult,
    OmniRequest,
    OmniScheduler,
    Progress,
    TextDelta,
)
from triton_omni.triton import omni_io
from triton_omni.triton.metrics import GAUGE, StageMetrics, family, release_model, report_restarts, routed
from triton_omni.triton.params import client_parameters
from triton_omni.triton.responses import ResponseThread
from triton_omni.triton.stages import TritonStages
from triton_omni.triton.tensors import Outputs, read_inputs
from triton_omni_protocol import OMNI_INPUTS, OMNI_OUTPUTS

OUTPUTS = Outputs(OMNI_OUTPUTS)


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return omni_io.auto_complete(auto_complete_model_config)

    def initialize(self, args):
        self.model_name = args["model_name"]
        self.context = f"model '{self.model_name}'"  # in error messages and logs
        settings = omni_io.settings(json.loads(args["model_config"]))
        self.limits = settings.limits
        self.responses = ResponseThread()  # sends every response and metric update (metrics.Routed)
        self.restarts = report_restarts(self.model_name)
        self.metrics = StageMetrics("scheduler", self.model_name, args["model_version"], submit=self.responses.call)
        labels = self.metrics.labels
        embeds_gauge = routed(family("omni_embeds_bytes_in_flight", "Bytes of prompt embeddings admitted and not "
                                     "yet diffused", GAUGE).Metric(labels=labels), self.responses.call)
        embeds_gauge.set(0)  # what a killed predecessor admitted is gone with it (StageMetrics.in_flight)
        self.loop = EventLoopThread("omni-scheduler")
        self.progress = self.loop.run(ProgressListener().start())
        self.stages = TritonStages(settings.ar_model, settings.encoder_model, settings.diffusion_model,
                                   self.progress, Cancellations(), speech_model=settings.speech_model,
                                   speech_checkpoint=settings.speech_checkpoint)
        budget = self.loop.run(_in_loop(lambda: EmbedsBudget(settings.budget, embeds_gauge.set)))
        self.scheduler = OmniScheduler(self.stages, budget, settings.enhance)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = OmniRequest.from_inputs(read_inputs(request, OMNI_INPUTS), self.limits,
                                                 client_parameters(request))
            except Exception as exc:
                self.responses.fail(sender, exc, self.context, self.metrics)
                continue
            self.loop.submit(self._serve(parsed, sender, time.monotonic()))
        return None

    async def _serve(self, request: OmniRequest, sender, started: float) -> None:
        async with self.responses.serving(sender, self.context, self.metrics, started):
            if request.stream:
                async for event in self.scheduler.run(request):
                    self.responses.send(sender, _event_response(event))
                self.responses.send(sender, None, final=True)
            else:
                events = [event async for event in self.scheduler.run(request)]
                self.responses.send(sender, _summary_response(events), final=True)

    def finalize(self):
        self.progress.close()
        self.stages.close()
        self.loop.stop()
        self.responses.stop()
        release_model(self)


async def _in_loop(make):
    """Build an asyncio object (``EmbedsBudget`` holds a Condition) on the scheduler's loop."""
    return make()


def _event_response(event) -> pb_utils.InferenceResponse:
    outputs = []
    if isinstance(event, TextDelta):
        outputs.append(OUTPUTS.tensor("text_output", event.text))
        if event.finish_reason is not None:
            outputs.append(OUTPUTS.tensor("finish_reason", event.finish_reason))
    elif isinstance(event, EnhancedPrompt):
        outputs.append(OUTPUTS.tensor("enhanced_prompt" if event.done else "enhanced_prompt_delta", event.text))
    elif isinstance(event, Progress):
        outputs += [OUTPUTS.tensor("stage", event.stage), OUTPUTS.tensor("step", event.step),
                    OUTPUTS.tensor("total_steps", event.total),
                    OUTPUTS.tensor("image_index", event.image_index)]
    elif isinstance(event, ImageResult):
        outputs += _media_outputs(torch.from_dlpack(event.image.to_dlpack()), [event.index], event.fps)
    elif isinstance(event, AudioChunk):
        outputs += _audio_outputs([event])
    return pb_utils.InferenceResponse(output_tensors=outputs)


def _summary_response(events: list) -> pb_utils.InferenceResponse:
    """Everything a non-streaming request produced, in one response."""
    texts = [e for e in events if isinstance(e, TextDelta)]
    enhanced = [e for e in events if isinstance(e, EnhancedPrompt) and e.done]
    images = sorted((e for e in events if isinstance(e, ImageResult)), key=lambda e: e.index)
    outputs = []
    if texts:
        outputs.append(OUTPUTS.tensor("text_output", "".join(e.text for e in texts)))
        finish = next((e.finish_reason for e in reversed(texts) if e.finish_reason), None)
        if finish:
            outputs.append(OUTPUTS.tensor("finish_reason", finish))
    if enhanced:
        outputs.append(OUTPUTS.tensor("enhanced_prompt", enhanced[-1].text))
    if images:
        stacked = torch.cat([torch.from_dlpack(e.image.to_dlpack()) for e in images])
        outputs += _media_outputs(stacked, [e.index for e in images], images[0].fps)
    audio = [e for e in events if isinstance(e, AudioChunk)]
    if audio:
        outputs += _audio_outputs(audio)
    return pb_utils.InferenceResponse(output_tensors=outputs)


def _audio_outputs(chunks: list[AudioChunk]) -> list:
    """The chunks' samples one after another, their rate, and the codec frames they end."""
    samples = [torch.from_dlpack(c.audio.to_dlpack()).reshape(-1) for c in chunks]
    codes = [torch.from_dlpack(c.codes.to_dlpack()) for c in chunks]
    return [OUTPUTS.tensor("audio", torch.cat(samples)), OUTPUTS.tensor("sample_rate", chunks[0].sample_rate),
            OUTPUTS.tensor("audio_codes", torch.cat(codes, dim=1))]


def _media_outputs(media: torch.Tensor, indices: list[int], fps: float | None) -> list:
    """``image`` [N, H, W, 3] (through DLPack, no copy), its indices and its shape; a video model's
    ``video`` [N, F, H, W, 3], its shape and ``fps`` in place of the image's."""
    if fps is None:
        return [OUTPUTS.tensor("image", media), OUTPUTS.tensor("image_index", indices),
                OUTPUTS.tensor("image_shape", list(media.shape))]
    return [OUTPUTS.tensor("video", media), OUTPUTS.tensor("image_index", indices),
            OUTPUTS.tensor("video_shape", list(media.shape)), OUTPUTS.tensor("fps", fps)]
