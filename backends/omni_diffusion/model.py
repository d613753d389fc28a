"""Python-based Triton backend ``omni_diffusion``: the diffusion stage.

A thin adapter: each request's tensors become a typed ``DiffusionRequest``
(validated alone: a bad request fails alone), the runner runs the valid ones,
images (or a video's frames) leave through DLPack. Cancellation is polled between denoising steps.

Two modes (model parameter ``batching``):
- ``request``: ``execute`` runs Triton's batch from its first step to its
  last and returns the responses;
- ``step``: ``execute`` hands each request to the runner's step engine and
  returns at once; a request joins the running batch at the next step and its
  image goes back through its response sender when its own steps are done.
  The model stays non-decoupled (one response per request), so plain HTTP
  ``/infer`` callers and the ensembles see the same contract.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import triton_omni.triton  # noqa: F401 - first: fixes the stub's locale before torch reads files
import triton_python_backend_utils as pb_utils
from triton_omni.channel import Cancellations, ProgressSender
from triton_omni.diffusion import DiffusionRunner
from triton_omni.gpu_memory import check_share
from triton_omni.triton import diffusion_io
from triton_omni.triton.balance import InstanceLoads
from triton_omni.triton.batch import run_batch
from triton_omni.triton.errors import error_response
from triton_omni.triton.metrics import (
    COUNTER,
    HISTOGRAM,
    DeferredCounter,
    StageMetrics,
    family,
    release_model,
    report_restarts,
    routed,
)
from triton_omni.triton.params import channel_ids
from triton_omni.triton.responses import ResponseThread
from triton_omni.triton.tensors import Outputs, read_inputs
from triton_omni_protocol import diffusion_inputs, diffusion_outputs

logger = logging.getLogger(__name__)
OUTPUTS = Outputs(diffusion_outputs())
SKIPPED_SHARE_BUCKETS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return diffusion_io.auto_complete(auto_complete_model_config)

    def initialize(self, args):
        self.model_name = args["model_name"]
        self.context = f"model '{self.model_name}'"  # in error messages and logs
        model_config = json.loads(args["model_config"])
        self.config, self.placement = diffusion_io.runner_config(model_config, args)
        if self.config.gpu_memory_utilization is not None:  # fail now, with the numbers, if the share is not free
            check_share(self.model_name, self.config.gpu_memory_utilization, self.placement.gpus)
        embeds_dtype = diffusion_io.model_parameters(model_config).get("embeds_dtype", "float32")
        self.input_specs = diffusion_inputs(embeds_dtype)
        self.poll_s = float(diffusion_io.model_parameters(model_config).get("cancel_poll_s", "0.02"))
        # step batching answers from a response thread, which then sends every metric update too
        # (metrics.Routed); request batching answers from execute, whose thread sends them
        stepping = self.config.batching == "step"
        # decoupled (model_transaction_policy): a progress response per step, then the image
        self.streams_progress = bool(model_config.get("model_transaction_policy", {}).get("decoupled"))
        if self.streams_progress and not stepping:
            raise ValueError(f"{self.context}: a decoupled diffusion model streams each step's progress, "
                             f"which needs the parameter batching 'step' (got {self.config.batching!r})")
        self.responses = ResponseThread(poll_s=self.poll_s) if stepping else None
        submit = self.responses.call if stepping else None
        self.restarts = report_restarts(self.model_name)
        self.metrics = StageMetrics("diffusion", self.model_name, args["model_version"], batched=True, submit=submit,
                                    device=self.placement.label)
        self.steps = routed(family("omni_diffusion_steps_total", "Denoising steps run, per request",
                                   COUNTER).Metric(labels=self.metrics.labels), submit)
        captures = routed(family("omni_diffusion_graph_captures_total", "CUDA graphs of the denoiser captured",
                                 COUNTER).Metric(labels=self.metrics.labels), submit)
        # step caching (step batching, DiT families): steps that ran every block, steps that reused them
        cached_steps = family("omni_diffusion_cached_steps_total",
                              "Denoising steps of step-cached requests, computed or skipped", COUNTER)
        self.cached_steps = {outcome: routed(cached_steps.Metric(labels=self.metrics.labels | {"outcome": outcome}),
                                             submit) for outcome in ("computed", "skipped")}
        self.skipped_share = routed(family(
            "omni_diffusion_skipped_step_ratio", "Per step-cached request: its steps skipped, over its steps",
            HISTOGRAM).Metric(labels=self.metrics.labels, buckets=SKIPPED_SHARE_BUCKETS), submit)
        # torch.compile's compilations (`compile`): flat once warm; a rise under load is a step batch stalled
        compiles = routed(family("omni_diffusion_compiles_total", "torch.compile compilations of this stage's "
                                 "networks", COUNTER).Metric(labels=self.metrics.labels), submit)
        compile_seconds = routed(family("omni_diffusion_compile_seconds_total", "Seconds spent in torch.compile "
                                        "compilations", COUNTER).Metric(labels=self.metrics.labels), submit)

        def on_compile(seconds: float) -> None:
            compiles.increment(1)
            compile_seconds.increment(seconds)

        # step batching: the batch size is the requests of each denoising step
        self.runner = DiffusionRunner(self.config, on_batch=lambda n: self.metrics.batch_size.observe(n),
                                      on_capture=lambda: captures.increment(1), on_lora=self.metrics.lora_event,
                                      on_compile=on_compile)
        self.cancellations = Cancellations()
        self.progress = ProgressSender()
        self.loads = None
        if stepping:
            self.step_count = DeferredCounter(self.steps)
            # execute returns at once: spread requests over the model's instances by their load
            self.loads = InstanceLoads.of_instance(args, model_config)

    def execute(self, requests):
        if self.runner.steps is not None:
            engine = self.runner.steps
            with engine.together():  # Triton's batch (a gathering max_queue_delay) shares its first step
                for request in requests:
                    self._submit(request)
            # a less loaded sibling takes the next requests; when this engine is full, Triton's queue keeps
            # them (unless it should reject when full: then it takes them, and refuses)
            self.loads.hold(full=lambda: engine.on_full == "wait" and not engine.has_room())
            return None
        started = time.monotonic()
        self.metrics.batch_size.observe(len(requests))
        results = run_batch(requests, parse=lambda request: self.runner.parse(read_inputs(request, self.input_specs)),
                            run=lambda indices, parsed: self._run([requests[i] for i in indices], parsed))
        ran = time.monotonic()
        responses = [self._response(result, started) for result in results]
        logger.debug("batch of %d: inputs and run %.1f ms, responses %.1f ms", len(requests),
                     (ran - started) * 1e3, (time.monotonic() - ran) * 1e3)
        return responses

    def _run(self, requests: list, parsed: list) -> list:
        """The valid requests of a batch, denoised together, with progress and cancellation."""
        channels = [channel_ids(request) for request in requests]  # set when the omni scheduler sent it
        watch = _StepWatch(requests, [key for key, _ in channels], self.cancellations, self.steps, self.poll_s)

        def on_step(k: int, step: int, total: int) -> None:
            watch.count_step()
            self.progress.send(channels[k][1], channels[k][0], step, total)

        self.metrics.in_flight.increment(len(requests))
        try:
            with watch:
                return self.runner.run(parsed, on_step=on_step, is_cancelled=watch.cancelled)
        finally:
            self.metrics.in_flight.increment(-len(requests))

    # -- step batching ------------------------------------------------------------

    def _submit(self, request) -> None:
        """One request into the step engine; its response leaves when its image is done."""
        started = time.monotonic()
        sender = request.get_response_sender()
        try:
            parsed = self.runner.parse(read_inputs(request, self.input_specs))
        except Exception as exc:
            self.responses.fail(sender, exc, self.context, self.metrics, started)
            return
        key, listener = channel_ids(request)
        cancelled = threading.Event()  # set by the response thread, read by the engine between steps
        self.responses.watch(sender, cancelled.set, lambda: self.cancellations.is_cancelled(key))

        def on_step(step: int, total: int) -> None:
            self.step_count.add(1)
            self.progress.send(listener, key, step, total)
            if self.streams_progress:  # a slow reader gets the latest step, not every one
                self.responses.send_streamed(sender, (step, total), final=False, merge=lambda _, latest: latest,
                                             build=_progress_response)

        def done(image) -> None:
            self.loads.add(-1)
            self.metrics.in_flight.increment(-1)
            self.step_count.flush()
            try:
                response = self._response(image.result(), started)
            except Exception as exc:
                response = error_response(exc, self.context, self.metrics, started)
            self.responses.send(sender, response, final=True)

        self.metrics.in_flight.increment(1)
        self.loads.add(1)
        try:
            future = self.runner.submit(parsed, on_step, cancelled.is_set, on_cached=self._count_cached)
        except Exception as exc:  # prepared inputs refused (too long a prompt), or the engine full
            self.loads.add(-1)
            self.metrics.in_flight.increment(-1)
            self.responses.fail(sender, exc, self.context, self.metrics, started)
            return
        future.add_done_callback(done)

    def _count_cached(self, computed: int, skipped: int) -> None:
        self.cached_steps["computed"].increment(computed)
        self.cached_steps["skipped"].increment(skipped)
        self.skipped_share.observe(skipped / max(1, computed + skipped))

    def _response(self, result, started: float):
        if isinstance(result, Exception):
            return error_response(result, self.context, self.metrics, started)
        self.metrics.finished("success", started)
        output = self.runner.output  # the family's: an image, or a video's frames and their frame rate
        tensors = [OUTPUTS.tensor(output.name, result, batched=True)]
        if output.video:
            tensors.append(OUTPUTS.tensor("fps", output.fps, batched=True))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.runner.close()
        if self.responses is not None:
            self.responses.stop()
        if self.loads is not None:
            self.loads.close()
        self.progress.close()
        release_model(self)


def _progress_response(progress: tuple[int, int]):
    step, total = progress
    return pb_utils.InferenceResponse(output_tensors=[OUTPUTS.tensor("step", step, batched=True),
                                                      OUTPUTS.tensor("total_steps", total, batched=True)])


class _StepWatch:
    """Keeps round trips to the server off the denoising loop.

    ``request.is_cancelled()`` and a metric increment are IPC calls to the
    server; made per request per step (16 x 20 for an SD batch) they would
    add up to a noticeable share of the batch time on a GPU. A thread polls
    cancellation (the client's, and the scheduler's cancel flag) and flushes
    the step count every ``interval_s``; the step callback only reads flags
    and bumps a local counter.
    """

    def __init__(self, requests: list, keys: list, cancellations, steps_metric, interval_s: float = 0.02):
        self._requests, self._keys = requests, keys
        self._cancellations, self._steps_metric = cancellations, steps_metric
        self._cancelled = [False] * len(requests)
        self._steps, self._flushed = 0, 0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="omni-step-watch", daemon=True)

    def __enter__(self) -> _StepWatch:
        self._poll_once()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._flush()

    def cancelled(self, k: int) -> bool:
        return self._cancelled[k]

    def count_step(self) -> None:
        self._steps += 1  # only the denoising thread writes it

    def _poll(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._poll_once()

    def _poll_once(self) -> None:
        for k, request in enumerate(self._requests):
            if not self._cancelled[k]:
                self._cancelled[k] = request.is_cancelled() or self._cancellations.is_cancelled(self._keys[k])
        self._flush()

    def _flush(self) -> None:
        steps = self._steps
        if steps > self._flushed:
            self._steps_metric.increment(steps - self._flushed)
            self._flushed = steps

