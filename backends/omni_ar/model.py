"""Python-based Triton backend ``omni_ar``: the AR stage.

A thin adapter: tensors in -> typed request -> ``ArRunner`` -> tensors out,
errors mapped in one place. ``mode: generate`` models (``ar``) are decoupled
and stream text; ``mode: encode`` models (``ar_encoder``) return the prompts'
last hidden states, one response per request.

How ``ar_encoder`` meets its engine depends on who batches:

- vLLM batches by itself, at every engine step. ``execute`` hands each
  request to the engine and returns at once; the answer goes back later
  through the request's response sender (Triton allows that for a
  non-decoupled model: exactly one final response per request). Triton then
  keeps feeding the engine while it runs, and concurrent callers share its
  steps, as they do calling vLLM directly (a blocking ``execute`` made
  closed-loop callers split into two half-batches that took turns).
- The transformers engine encodes one batch per call, so ``execute`` blocks
  on it and Triton's dynamic batcher collects the next batch meanwhile.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

import torch
import triton_omni.triton  # noqa: F401 - first: fixes the stub's locale before torch/vLLM read files
import triton_python_backend_utils as pb_utils
from triton_omni.ar import ArResponse, ArRunner, EncodeRequest, GenerateRequest
from triton_omni.channel import Cancellations
from triton_omni.gpu_memory import check_share
from triton_omni.triton import ar_io
from triton_omni.triton.balance import InstanceLoads
from triton_omni.triton.batch import run_batch
from triton_omni.triton.errors import error_response
from triton_omni.triton.metrics import StageMetrics, release_model, report_restarts
from triton_omni.triton.params import split_parameters
from triton_omni.triton.responses import ResponseThread
from triton_omni.triton.tensors import Outputs, read_inputs
from triton_omni_protocol import AR_ENCODE_INPUTS, AR_GENERATE_INPUTS, ar_encode_outputs

logger = logging.getLogger("omni_ar")


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return ar_io.auto_complete(auto_complete_model_config)

    def initialize(self, args):
        self.model_name = args["model_name"]
        self.context = f"model '{self.model_name}'"  # in error messages and logs
        model_config = json.loads(args["model_config"])
        self.config, self.placement = ar_io.runner_config(model_config, args)
        seat = ar_io.engine_seat(model_config, self.config, self.placement)  # instances_per_engine > 1
        try:
            if self.config.gpu_memory_utilization is not None and (seat is None or seat.starts_engine):
                # fail now, with the numbers, if the share is not free (an engine's first instance takes it)
                check_share(self.model_name, self.config.gpu_memory_utilization, self.placement.gpus)
            # (the metrics come after the runner, whose engine start may fail)
            self.runner = ArRunner(self.config, seat, on_lora=lambda event, adapter: self.metrics.lora_event(
                event, adapter))
        except BaseException:
            if seat is not None:
                seat.release()
            raise
        self.responses = ResponseThread()  # sends every response and metric update (metrics.Routed)
        self.restarts = report_restarts(self.model_name)
        self.metrics = StageMetrics("ar", self.model_name, args["model_version"], batched=self.config.mode == "encode",
                                    submit=self.responses.call,
                                    device=self.placement.label)
        self.encode_outputs = Outputs(ar_encode_outputs(self.config.embeds_dtype))
        self.cancellations = Cancellations()
        # generation (decoupled) and encoding on vLLM return from execute at once: spread requests
        # over the model's instances (one engine per GPU, --place ar=0,1) by their load
        returns_at_once = self.config.mode == "generate" or self.runner.engine_name == "vllm"
        self.loads = InstanceLoads.of_instance(args, model_config) if returns_at_once else None

    def execute(self, requests):
        if self.config.mode == "encode":
            if self.runner.engine_name == "vllm":
                self._start_encoding(requests)
                self.loads.hold()  # a less loaded sibling instance takes the next requests
                return None
            return self._encode_batch(requests)
        for request in requests:
            self._start_generation(request)
        self.loads.hold()
        return None

    # -- generate (decoupled) -------------------------------------------------

    def _start_generation(self, request) -> None:
        started = time.monotonic()
        sender = request.get_response_sender()
        try:
            parameters, key, _ = split_parameters(request)
            parsed = GenerateRequest.from_inputs(read_inputs(request, AR_GENERATE_INPUTS), self.config.limits,
                                                 parameters, self.runner.audio_limits, self.runner.image_limits)
            self.runner.check(parsed)
        except Exception as exc:
            self.responses.fail(sender, exc, self.context, self.metrics, started)
            return
        self.loads.add(1)
        self.runner.loop.submit(self._generate(parsed, sender, key, started))

    async def _generate(self, request: GenerateRequest, sender, key: str | None, started: float) -> None:
        """``key``: set when the omni scheduler sent the request; it cancels through the channel.

        A cancellation (the client's, or the scheduler's flag) cancels this
        task at once, wherever it waits (a long prefill included); the engine
        aborts the request and the client gets CANCELLED."""
        request_id = uuid.uuid4().hex
        first = True  # the stream's first response leaves in the urgent lane (responses.py)

        def first_token() -> None:
            self.metrics.time_to_first_token.observe(time.monotonic() - started)

        def respond(response: ArResponse) -> None:  # on the engine's loop, as the engine produces it
            nonlocal first
            self.metrics.generated_tokens.add(sum(response.num_output_tokens))  # new since last response
            if response.final:  # counted before the client can read the last response
                self.metrics.generated_tokens.flush()
            if request.stream:  # under load, responses still queued merge (responses.py)
                self.responses.send_streamed(
                    sender, response, response.final, merge=ArResponse.absorb,
                    build=lambda merged, wanted=request.outputs: ar_io.generate_response(merged, wanted),
                    urgent=first)
                first = False
            else:
                self.responses.send(sender, ar_io.generate_response(response, request.outputs),
                                    final=response.final)

        async def abort() -> None:
            await self.runner.abort(request_id)
            self.metrics.generated_tokens.flush()  # what the engine made until it stopped

        try:
            async with self.responses.serving(sender, self.context, self.metrics, started,
                                              cancelled_elsewhere=lambda: self.cancellations.is_cancelled(key),
                                              on_cancel=abort, key=key):
                try:
                    await self.runner.stream(request, request_id, respond, on_first_token=first_token)
                finally:  # the count is exact once a request ends, before it leaves the in-flight gauge
                    self.metrics.generated_tokens.flush()
        finally:
            self.loads.add(-1)

    # -- encode ---------------------------------------------------------------

    def _start_encoding(self, requests) -> None:
        """Each request to the engine on its own; a bad one fails alone, at once."""
        started = time.monotonic()
        self.metrics.batch_size.observe(len(requests))
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = self._parse_encoding(request)
            except Exception as exc:
                self.responses.fail(sender, exc, self.context, self.metrics, started)
                continue
            self.loads.add(1)
            self.runner.loop.submit(self._encode_one(parsed, sender, started))

    async def _encode_one(self, request: EncodeRequest, sender, started: float) -> None:
        try:
            [result] = await self.runner.encode([request])
            self.responses.send(sender, self._encode_response(result, started), final=True)
        except Exception as exc:
            self.responses.fail(sender, exc, self.context, self.metrics, started)
        finally:
            self.loads.add(-1)

    def _encode_batch(self, requests):
        """One response per request, in order; a bad request fails alone."""
        started = time.monotonic()
        self.metrics.batch_size.observe(len(requests))
        results = run_batch(
            requests,
            parse=self._parse_encoding,
            run=lambda _, parsed: self.runner.loop.run(self.runner.encode(parsed)),
        )
        return [self._encode_response(result, started) for result in results]

    def _parse_encoding(self, request) -> EncodeRequest:
        """The negative side is encoded when given, or when its output is asked for (the
        text_to_image ensemble maps it; a caller that asks for every output gets it too)."""
        wanted = "negative_prompt_embeds" in request.requested_output_names()
        return EncodeRequest.from_inputs(read_inputs(request, AR_ENCODE_INPUTS), self.config.limits, wanted,
                                         self.runner.image_limits)

    def _encode_response(self, result, started: float):
        if isinstance(result, Exception):
            return error_response(result, self.context, self.metrics, started)
        self.metrics.finished("success", started)
        outputs = []
        for name, hidden in (("prompt_embeds", result.hidden_states),
                             ("negative_prompt_embeds", result.negative_hidden_states)):
            if hidden is not None:
                mask = hidden.new_ones(hidden.shape[0], dtype=torch.int32)
                outputs += [self.encode_outputs.tensor(name, hidden, batched=True),
                            self.encode_outputs.tensor(f"{name}_mask", mask, batched=True)]
        # always there (zero values for a family without one): the text_to_image ensemble maps it
        pooled = result.pooled if result.pooled is not None else result.hidden_states.new_empty(0)
        outputs.append(self.encode_outputs.tensor("pooled_prompt_embeds", pooled, batched=True))
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def finalize(self):
        self.runner.close()
        self.responses.stop()
        if self.loads is not None:
            self.loads.close()
        release_model(self)

