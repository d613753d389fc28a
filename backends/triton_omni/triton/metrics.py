"""Custom Prometheus metrics through ``pb_utils.MetricFamily``.

Every metric is labelled ``{model, version}`` so that several models built on
one backend (``ar``, ``ar_encoder``) stay apart, and the stages' also
``{device}`` (``cpu``, ``gpu0``, ``gpu0+gpu1`` for an engine over two GPUs,
numbered as ``nvidia-smi`` does), so that a dashboard shows the load of each
GPU. Instances on one device share their series. Families are registered
once per process by name; Triton shares a family between models of the same
name and kind.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

import triton_python_backend_utils as pb_utils

COUNTER = "COUNTER"
GAUGE = "GAUGE"
HISTOGRAM = "HISTOGRAM"

# Seconds: from milliseconds (a tiny encoder) to minutes (1000-step diffusion).
DURATION_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
# the speech runner's FIRST_AUDIO_PHASES (named here: this module loads no torch)
SPEECH_PHASES = ("prompt", "join", "first_frame", "frames", "decode")
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64]

_families: dict[str, object] = {}


def family(name: str, description: str, kind: str):
    # pb_utils.MetricFamily exists only once the model is initialised (not
    # during auto_complete_config), so it is looked up here, not at import.
    if name not in _families:
        kind_value = getattr(pb_utils.MetricFamily, kind)
        _families[name] = pb_utils.MetricFamily(name=name, description=description, kind=kind_value)
    return _families[name]


def release_families() -> None:
    """Destroy this process's metric families now (``release_model`` first
    drops the model's own references to their metrics)."""
    _families.clear()
    gc.collect()


def release_model(model: object) -> None:
    """The last line of a stub's ``finalize``: every attribute of ``model``
    dropped, then this process's metric families destroyed.

    A ``MetricFamily`` or ``Metric`` destroyed at interpreter exit, after the
    stub's shared memory is gone, segfaults the Triton 2.51 stub
    (``Metric::~Metric`` -> the shared memory's mutex). Metrics hide in more
    places than a model's ``StageMetrics``: the runner's callbacks, deferred
    and per-outcome counters. So all of the model's state goes (Triton calls
    nothing on a finalized model), and with it every metric it reaches."""
    vars(model).clear()
    release_families()


class DeferredCounter:
    """A counter's increments added up here and passed on at most every
    ``period_s``: each ``increment`` of a Triton metric is an IPC round trip
    to the server, too slow to make once per generated token."""

    def __init__(self, counter, period_s: float = 0.1):
        self.counter = counter
        self.period_s = period_s
        self._pending = 0
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def add(self, value: int) -> None:
        with self._lock:
            self._pending += value
            if time.monotonic() - self._last < self.period_s:
                return
        self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending, self._last = self._pending, 0, time.monotonic()
        if pending:
            self.counter.increment(pending)


Submit = Callable[[Callable[[], None]], None]


class Routed:
    """A metric whose updates run on one thread (``submit``), not the caller's.

    Each update is an IPC message to the server. A Triton 2.51 server crashed
    (SIGSEGV in the Python backend, after a few hundred requests at 50/s)
    when a stub's step engine thread updated metrics while its response
    thread sent responses; with every update sent from the response thread it
    ran clean. So the stubs that answer from a response thread route their
    metrics through it too (``ResponseThread.call``), in order with the
    responses: a request is counted before its final response leaves."""

    def __init__(self, metric, submit: Submit):
        self.metric, self._submit = metric, submit
        self._pending = 0.0  # increments not yet sent (under _lock)
        self._flush_queued = False
        self._lock = threading.Lock()

    def increment(self, value: float) -> None:
        """Increments add up until the one queued update runs and sends their sum.
        Why: under load the response thread is the stub's bottleneck (each
        update is an IPC round trip, like each send), and the increments of the
        requests that finished while it was busy then leave as one update.
        Still in order: an increment is in the sum of an update queued before
        anything its caller queues next (a request counted before its response)."""
        with self._lock:
            self._pending += value
            if self._flush_queued:
                return
            self._flush_queued = True
        self._submit(self._flush)

    def _flush(self) -> None:
        with self._lock:
            value, self._pending, self._flush_queued = self._pending, 0.0, False
        if value:
            self.metric.increment(value)

    def observe(self, value: float) -> None:
        self._submit(lambda: self.metric.observe(value))

    def set(self, value: float) -> None:
        self._submit(lambda: self.metric.set(value))


def routed(metric, submit: Submit | None):
    """``metric`` itself, or updated through ``submit`` when one is given."""
    return metric if submit is None else Routed(metric, submit)


def report_restarts(model: str):
    """``omni_stage_restarts_total{model}``: how many times the launcher's
    supervisor brought this model back after its stub died, reported as the
    model loads (the count lives in a file of the server's run dir). Keep
    the returned metric referenced: the series lives as long as it does."""
    from triton_omni.channel import restart_count

    count = restart_count(model)
    metric = family("omni_stage_restarts_total", "Times the supervisor restarted a model whose stub died",
                    COUNTER).Metric(labels={"model": model})
    # A killed stub never released its series, and the server hands the same one to the new stub
    # (same family, same labels): it may already hold part of the count.
    missing = count - metric.value()
    if missing > 0:
        metric.increment(missing)
    return metric


class StageMetrics:
    """Per stage: requests by outcome and in flight, request duration, requests
    rejected by reason; (AR) generated tokens and time to first token;
    (batched stages) executed batch size. ``submit``: the thread that sends
    every update (``Routed``); None: the caller's. ``device``: the instance's
    (``Placement.label``), a label of every series."""

    def __init__(self, stage: str, model: str, version: str, batched: bool = False, submit: Submit | None = None,
                 device: str | None = None):
        self.labels = {"model": model, "version": str(version)} | ({"device": device} if device else {})
        self.stage = stage
        self._submit = submit
        self.in_flight = routed(family(f"omni_{stage}_requests_in_flight", f"Requests the {stage} stage is working on",
                                       GAUGE).Metric(labels=self.labels), submit)
        # A killed stub never takes its requests off the gauge, and the server hands the same series to the
        # stub that replaces it: a model's instances start with nothing in flight, so they say so.
        self.in_flight.set(0)
        self._requests = family(f"omni_{stage}_requests_total",
                                f"Requests finished by the {stage} stage, by outcome", COUNTER)
        self._rejected = family("omni_rejected_requests_total", "Requests refused by admission control, by reason",
                                COUNTER)
        self._by_label: dict[tuple, object] = {}  # (family, extra labels) -> counter (Routed with submit)
        self._by_label_lock = threading.Lock()
        self.duration = routed(family(f"omni_{stage}_request_duration_seconds",
                                      f"Time from the {stage} stage receiving a request to its final response",
                                      HISTOGRAM).Metric(labels=self.labels, buckets=DURATION_BUCKETS), submit)
        if stage == "ar":
            self.generated_tokens = DeferredCounter(routed(family(
                "omni_ar_generated_tokens_total", "Tokens generated by the AR stage", COUNTER,
            ).Metric(labels=self.labels), submit))
            self.time_to_first_token = routed(family(
                "omni_ar_time_to_first_token_seconds", "Time from receiving a generate request to its first token",
                HISTOGRAM).Metric(labels=self.labels, buckets=TTFT_BUCKETS), submit)
        if stage == "speech":
            self.time_to_first_audio = routed(family(
                "omni_speech_time_to_first_audio_seconds", "Time from receiving a speech request to its first audio",
                HISTOGRAM).Metric(labels=self.labels, buckets=TTFT_BUCKETS), submit)
            self.audio_seconds = routed(family(
                "omni_speech_audio_seconds_total", "Seconds of audio the speech stage produced", COUNTER,
            ).Metric(labels=self.labels), submit)
            phases = family("omni_speech_first_audio_phase_seconds",
                            "Where a speech request's first audio waited, by phase: prompt (the talker's prompt "
                            "built), join (into the talker's step batch: the running step, then the prefill), "
                            "first_frame (its reply's next tokens, the step), frames (the other frames its "
                            "samples need: the talker's steps, each waiting for its reply's next state), decode "
                            "(their decode: the codec thread's batch)", HISTOGRAM)
            self.first_audio_phases = {
                phase: routed(phases.Metric(labels=self.labels | {"phase": phase}, buckets=TTFT_BUCKETS), submit)
                for phase in SPEECH_PHASES}
        self.batch_size = routed(family(f"omni_{stage}_batch_size", f"Requests per executed {stage} batch",
                                        HISTOGRAM).Metric(labels=self.labels, buckets=BATCH_BUCKETS),
                                 submit) if batched else None

    def finished(self, outcome: str, started: float | None = None) -> None:
        """Count a finished request; ``started`` (``time.monotonic()``) adds its duration."""
        self.count(self._requests, outcome=outcome)
        if started is not None:
            self.duration.observe(time.monotonic() - started)

    def rejected(self, reason: str) -> None:
        self.count(self._rejected, reason=reason)

    def lora_event(self, event: str, adapter: str) -> None:
        """+1 on ``omni_<stage>_lora_<event>s_total`` for ``adapter``: a request that named it, its
        load onto the device, or its eviction (``triton_omni.lora.Adapters``' events)."""
        what = {"request": "Requests that named a LoRA adapter", "load": "LoRA adapters copied onto the device",
                "eviction": "LoRA adapters emptied from the device for another"}[event]
        self.count(family(f"omni_{self.stage}_lora_{event}s_total", f"{what}, per adapter", COUNTER), adapter=adapter)

    def count(self, metric_family, **extra: str) -> None:
        """+1 on the family's metric with these extra labels (made on first use, on the submitting thread)."""
        key = (id(metric_family), *sorted(extra.items()))
        with self._by_label_lock:
            counter = self._by_label.get(key)
            if counter is None:
                make = lambda: metric_family.Metric(labels=self.labels | extra)  # noqa: E731
                counter = self._by_label[key] = make() if self._submit is None else Routed(_Made(make), self._submit)
        counter.increment(1)


class _Made:
    """A metric made at its first update, on the thread that updates it (making one is an IPC too)."""

    def __init__(self, make: Callable[[], object]):
        self._make, self._metric = make, None

    def increment(self, value: float) -> None:
        if self._metric is None:
            self._metric = self._make()
        self._metric.increment(value)
