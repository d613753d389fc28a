"""Metric updates routed through the response thread (``metrics.Routed``) on a
fake ``pb_utils`` that records each update (an IPC round trip in a real stub):
increments coalesce while an update is queued, and still reach the server
before whatever their caller queues next (a request is counted before its
response leaves)."""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

from tests.support import fake_pb_utils

fake_pb_utils.install()
from triton_omni.triton.metrics import COUNTER, StageMetrics, family, release_families, release_model  # noqa: E402
from triton_omni.triton.responses import ResponseThread  # noqa: E402


class Queued:
    """A response thread stand-in: callables queued, run when told to."""

    def __init__(self):
        self.queue: list = []

    def __call__(self, fn) -> None:
        self.queue.append(fn)

    def run(self) -> None:
        queue, self.queue = self.queue, []
        for fn in queue:
            fn()


def updates(name: str, method: str = "increment") -> list[float]:
    return [value for fam, _, how, value, _ in fake_pb_utils.metric_updates if fam == name and how == method]


def test_increments_queued_behind_one_update_leave_as_one():
    fake_pb_utils.metric_updates.clear()
    submit = Queued()
    metrics = StageMetrics("ar_encoder", "ar_encoder", "1", submit=submit)
    for _ in range(5):  # five requests finish while the response thread is busy
        metrics.finished("success")
        submit(lambda: None)  # each one's response, queued after its count
    assert updates("omni_ar_encoder_requests_total") == []
    submit.run()
    assert updates("omni_ar_encoder_requests_total") == [5.0]  # one IPC, not five
    metrics.finished("success")  # the thread idle again: its own update
    metrics.finished("error")  # another label, another series
    submit.run()
    assert updates("omni_ar_encoder_requests_total") == [5.0, 1.0, 1.0]
    release_families()


def test_a_count_leaves_before_the_response_queued_after_it():
    fake_pb_utils.metric_updates.clear()
    thread = ResponseThread()
    metrics = StageMetrics("diffusion", "diffusion", "1", submit=thread.call)
    seen = []
    try:
        for _ in range(200):
            metrics.in_flight.increment(1)
            metrics.finished("success")
            metrics.in_flight.increment(-1)
            # what a client reading /metrics after its response would see
            thread.call(lambda: seen.append(sum(updates("omni_diffusion_requests_total"))))
    finally:
        thread.stop()
    # each request counted by the time its response left (with later ones, merged: never late)
    assert all(count >= i + 1 for i, count in enumerate(seen)), seen
    assert seen[-1] == 200
    # updated on the response thread only (the per-outcome counter made there too: making one is an
    # IPC), the in-flight gauge's +1/-1 merged away
    on = {(fam, how, thread_name) for fam, _, how, _, thread_name in fake_pb_utils.metric_updates}
    assert {thread_name for _, how, thread_name in on if how != "made"} == {"omni-responses"}
    assert ("omni_diffusion_requests_total", "made", "omni-responses") in on
    assert sum(updates("omni_diffusion_requests_in_flight")) == 0
    assert len(updates("omni_diffusion_requests_total")) <= 200
    release_families()


def test_without_a_response_thread_updates_are_immediate():
    fake_pb_utils.metric_updates.clear()
    metrics = StageMetrics("ar", "ar", "1")
    metrics.finished("success")
    metrics.finished("success")
    assert updates("omni_ar_requests_total") == [1.0, 1.0]
    counter = family("omni_ar_requests_total", "", "COUNTER")
    assert counter.name == "omni_ar_requests_total"
    release_families()


class _Runner:
    """A runner that, like the diffusion runner, keeps a callback that updates a metric."""

    def __init__(self, on_capture):
        self.on_capture = on_capture


def _finalized_model_metrics(release) -> list:
    """The metrics a stub-like model made, still alive after ``release(model)``."""

    class Model:
        pass

    model = Model()
    model.metrics = StageMetrics("diffusion", "diffusion", "1", batched=True)
    captures = family("omni_diffusion_graph_captures_total", "", COUNTER).Metric(labels=model.metrics.labels)
    model.runner = _Runner(on_capture=captures.increment)
    alive = [weakref.ref(model.metrics.duration), weakref.ref(captures)]
    del captures
    release(model)
    gc.collect()
    return [ref() for ref in alive if ref() is not None]


def test_a_finalized_model_keeps_no_metric_alive():
    """A metric destroyed at the stub's exit, after its shared memory is gone, segfaults a Triton 2.51 stub:
    ``finalize`` must leave none. Dropping the ``StageMetrics`` alone is not enough (the runner's callback
    still holds a counter); ``release_model`` drops everything."""

    def stage_metrics_only(model):
        model.metrics = None
        release_families()

    assert len(_finalized_model_metrics(stage_metrics_only)) == 1  # the runner's captures counter
    assert _finalized_model_metrics(release_model) == []


def test_every_stub_that_makes_metrics_releases_its_model_last_in_finalize():
    backends = Path(__file__).resolve().parents[2] / "backends"
    stubs = [path for path in sorted(backends.glob("omni_*/model.py")) if "triton.metrics import" in path.read_text()]
    assert len(stubs) >= 4, stubs
    for path in stubs:
        tree = ast.parse(path.read_text())
        finalize = next(node for node in ast.walk(tree)
                        if isinstance(node, ast.FunctionDef) and node.name == "finalize")
        last = finalize.body[-1]
        assert ast.unparse(last) == "release_model(self)", f"{path}: finalize ends with {ast.unparse(last)!r}"
