"""A cancelled gRPC stream ends the request and the engine stops working on it."""

from __future__ import annotations

import json
import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.support.server import GENERATE_MODELS, metric_value


def _inputs():
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"tell a very long story"], dtype=np.object_))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps({"max_tokens": 1000, "ignore_eos": True}).encode()],
                                        dtype=np.object_))
    return [text, stream, params]


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.parametrize("model", GENERATE_MODELS)
def test_cancelled_stream_stops_the_engine(server, model):
    in_flight = lambda: metric_value(server, "omni_ar_requests_in_flight", model=model)  # noqa: E731
    tokens = lambda: metric_value(server, "omni_ar_generated_tokens_total", model=model)  # noqa: E731
    # An earlier test's cancelled stream (test_ar_batching) may still be on its way out; counted meanwhile,
    # it would be taken for this one.
    assert wait_for(lambda: in_flight() == 0, timeout_s=60), f"{model} still busy with an earlier request"
    # A request can finish before its cancellation lands (on a loaded 2-core machine its responses can reach
    # the client late): that one is a success, rightly, and the test tries again. Only a cancellation that
    # never lands is a failure.
    for _ in range(3):
        tokens_before = tokens()
        counted = _cancel_one_stream(server, model)
        if counted != {"success": 1, "cancelled": 0, "error": 0}:
            break
    # Counted as cancelled, not as a success: the cancellation reached the request while it ran.
    assert counted == {"success": 0, "cancelled": 1, "error": 0}, f"outcomes counted since: {counted}"
    assert wait_for(lambda: in_flight() == 0, timeout_s=10), "the cancelled request is still in flight"
    settled = tokens()
    time.sleep(1.0)
    assert tokens() == settled, "tokens are still being generated"
    assert settled - tokens_before < 1000, "the engine generated the whole request"


def _cancel_one_stream(server, model) -> dict[str, float]:
    """Start a long stream, cancel it once it is under way; the outcomes counted since, by outcome."""
    outcomes = lambda: {outcome: metric_value(server, "omni_ar_requests_total", model=model, outcome=outcome)  # noqa: E731
                        for outcome in ("success", "cancelled", "error")}
    before = outcomes()
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(model, _inputs())
    _, error = responses.get(timeout=60)  # generation is under way
    assert error is None
    # Cancel at once: the tiny model writes its 1000 tokens in 3 to 6 s on a CPU, and on a loaded machine its
    # responses reach the client late, so waiting here (for more responses, a metric) can let it finish first.
    client.stop_stream(cancel_requests=True)
    client.close()

    def counted() -> dict[str, float]:
        after = outcomes()
        return {outcome: after[outcome] - before[outcome] for outcome in after}

    wait_for(lambda: sum(counted().values()) >= 1, timeout_s=10)
    return counted()
