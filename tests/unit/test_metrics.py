"""Metric updates routed through the response thread (``metrics.Routed``) on a
fake ``pb_utils`` that records each update (an IPC round trip in a real stub):
increments coalesce while an update is queued, and still reach the server
before whatever their caller queues next (a request is counted before its
response leaves)."""

from __future__ import annotations

from tests.support import fake_pb_utils

fake_pb_utils.install()
from triton_omni.triton.metrics import StageMetrics, family, release_families  # noqa: E402 - after the fake
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
