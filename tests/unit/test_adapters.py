"""The Triton adapters on a fake ``pb_utils``: the batch loop, the error
mapping, the response thread's final-response and failure paths."""

from __future__ import annotations

import threading

import pytest
from triton_omni.errors import RequestCancelledError, RequestRejectedError, RequestValidationError, StageError
from triton_omni_protocol import parse_status

from tests.support import fake_pb_utils

fake_pb_utils.install()
from triton_omni.triton.batch import run_batch  # noqa: E402 - after the fake pb_utils
from triton_omni.triton.errors import error_response, outcome, triton_error  # noqa: E402
from triton_omni.triton.responses import ResponseThread  # noqa: E402


def test_run_batch_fails_bad_requests_alone_and_answers_in_order():
    seen = {}

    def parse(request):
        if request < 0:
            raise RequestValidationError("x", "must be >= 0", request)
        return request * 10

    def run(indices, parsed):
        seen["indices"], seen["parsed"] = indices, parsed
        return [p + 1 if p != 20 else RuntimeError("engine said no") for p in parsed]

    results = run_batch([0, -1, 2, -3, 4], parse, run)
    assert seen == {"indices": [0, 2, 4], "parsed": [0, 20, 40]}
    assert results[0] == 1 and results[4] == 41
    assert isinstance(results[1], RequestValidationError) and isinstance(results[3], RequestValidationError)
    assert isinstance(results[2], RuntimeError)


def test_run_batch_with_no_valid_request_never_runs():
    assert all(isinstance(r, ValueError) for r in run_batch([1, 2], parse=lambda r: int("x"), run=None))


@pytest.mark.parametrize(("exc", "status", "label"), [
    (RequestValidationError("top_p", "must be in (0, 1]", 2), "INVALID_ARG", "invalid"),
    (RequestRejectedError("over budget", "embeds_budget"), "UNAVAILABLE", "rejected"),
    (RequestCancelledError(), "CANCELLED", "cancelled"),
    (StageError("diffusion", "INVALID_ARG", "invalid `height`"), "INVALID_ARG", "stage_error"),
    (RuntimeError("boom"), "INTERNAL", "error"),
])
def test_every_exception_becomes_a_tagged_typed_error(exc, status, label):
    error = triton_error(exc, "model 'x'")
    assert parse_status(error.message())[0] == status
    assert error.code() == getattr(fake_pb_utils.TritonError, status)
    assert outcome(exc) == label


class FakeMetrics:
    def __init__(self):
        self.finished_with, self.rejected_with = [], []

    def finished(self, label, started=None):
        self.finished_with.append(label)

    def rejected(self, reason):
        self.rejected_with.append(reason)


def test_error_response_counts_the_outcome_and_the_rejection_reason():
    metrics = FakeMetrics()
    response = error_response(RequestRejectedError("full", "embeds_budget"), "model 'omni'", metrics)
    assert response.has_error()
    assert metrics.finished_with == ["rejected"] and metrics.rejected_with == ["embeds_budget"]


class FakeSender:
    def __init__(self):
        self.sent, self.polls, self.done = [], 0, threading.Event()

    def send(self, response, flags=0):
        self.sent.append((response, flags))
        if flags & fake_pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.done.set()

    def is_cancelled(self):
        self.polls += 1
        return False


def test_the_response_thread_sends_in_order_ends_final_and_stops_polling_after_it():
    thread = ResponseThread(poll_s=0.001)
    sender = FakeSender()
    thread.watch(sender, on_cancel=lambda: None)
    thread.send(sender, "first")
    thread.fail(sender, RequestValidationError("n", "too large", 9), "model 'ar'", FakeMetrics())
    assert sender.done.wait(5)
    polls = sender.polls
    threading.Event().wait(0.05)
    thread.stop()
    assert sender.sent[0] == ("first", 0)
    final, flags = sender.sent[1]
    assert flags == fake_pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert parse_status(final.error().message()) == ("INVALID_ARG", "invalid `n`: too large, got 9")
    assert sender.polls == polls  # no is_cancelled() after the final response (it crashed tritonserver)
