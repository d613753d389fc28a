"""Python-based Triton backend ``omni_diffusion``: the diffusion stage.

A thin adapter: each request's tensors become a typed ``DiffusionRequest``
(validated alone: a bad request fails alone), the runner runs the valid ones
with exact batching, images leave through DLPack. Cancellation is polled
between denoising steps.
"""

from __future__ import annotations

import json
import logging
import time

import triton_omni.triton  # noqa: F401 - first: fixes the stub's locale before torch reads files
import triton_python_backend_utils as pb_utils
from triton_omni.channel import Cancellations, ProgressSender
from triton_omni.diffusion import DiffusionRunner
from triton_omni.triton import diffusion_io
from triton_omni.triton.errors import error_response
from triton_omni.triton.metrics import COUNTER, StageMetrics, family
from triton_omni.triton.params import channel_ids
from triton_omni.triton.tensors import numeric_tensor, read_inputs

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return diffusion_io.auto_complete(auto_complete_model_config)

    def initialize(self, args):
        self.model_name = args["model_name"]
        model_config = json.loads(args["model_config"])
        self.config = diffusion_io.runner_config(model_config, args)
        embeds_dtype = diffusion_io.model_parameters(model_config).get("embeds_dtype", "float32")
        self.input_specs = diffusion_io.inputs(embeds_dtype)
        self.runner = DiffusionRunner(self.config)
        self.metrics = StageMetrics("diffusion", self.model_name, args["model_version"], batched=True)
        self.steps = family("omni_diffusion_steps_total", "Denoising steps run, per request",
                            COUNTER).Metric(labels=self.metrics.labels)
        self.cancellations = Cancellations()
        self.progress = ProgressSender()

    def execute(self, requests):
        started = time.monotonic()
        self.metrics.batch_size.observe(len(requests))
        results: list = [None] * len(requests)
        valid: dict[int, object] = {}
        for i, request in enumerate(requests):
            try:
                valid[i] = self.runner.parse(read_inputs(request, self.input_specs))
            except Exception as exc:
                results[i] = exc
        if valid:
            indices = list(valid)
            channels = [channel_ids(requests[i]) for i in indices]  # set when the omni scheduler sent it

            def on_step(k: int, step: int, total: int) -> None:
                self.steps.increment(1)
                self.progress.send(channels[k][1], channels[k][0], step, total)

            def is_cancelled(k: int) -> bool:
                return requests[indices[k]].is_cancelled() or self.cancellations.is_cancelled(channels[k][0])

            self.metrics.in_flight.increment(len(indices))
            try:
                images = self.runner.run(list(valid.values()), on_step=on_step, is_cancelled=is_cancelled)
            finally:
                self.metrics.in_flight.increment(-len(indices))
            for k, image in enumerate(images):
                results[indices[k]] = image
        return [self._response(result, started) for result in results]

    def _response(self, result, started: float):
        if isinstance(result, Exception):
            return error_response(result, f"model '{self.model_name}'", self.metrics, started)
        self.metrics.finished("success", started)
        return pb_utils.InferenceResponse(output_tensors=[numeric_tensor("image", result, batched=True)])

    def finalize(self):
        self.progress.close()
