"""Concurrent `ar` requests through Triton, on both engines: each gets the
text it gets alone, and cancelling one leaves the others running.

The transformers engine decodes concurrent requests together (continuous
batching, tests/unit/test_ar_batching.py); vLLM does so by design."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.grpc as grpcclient
from triton_omni_client import OmniClient
from triton_omni_client.client import omni_inputs

from tests.support.server import GENERATE_MODELS

pytestmark = pytest.mark.parametrize("model", GENERATE_MODELS)

PROMPTS = ["A red fox", "a lighthouse on a cliff at dusk", "once upon a time", "x"]


def text(url: str, model: str, i: int) -> tuple[str, str]:
    """Seeded sampling for odd i, greedy for even i; different lengths."""
    options = {"max_tokens": 10 + 3 * i, "seed": 40 + i, "temperature": 0.9 if i % 2 else 0.0, "top_p": 0.95,
               "exclude_input_in_output": True, "sampling_parameters": {"ignore_eos": True}}
    [chunk] = OmniClient(url, "grpc").generate_text(PROMPTS[i % len(PROMPTS)], model=model, **options)
    return chunk.text, chunk.finish_reason


def test_concurrent_requests_get_their_own_seeded_text(grpc_url, model):
    alone = [text(grpc_url, model, i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: text(grpc_url, model, i), range(8)))
    assert together == alone
    assert all(reason == "length" for _, reason in together)


def test_cancelling_one_stream_leaves_the_others_running(grpc_url, model):
    responses: queue.Queue = queue.Queue()
    victim = grpcclient.InferenceServerClient(grpc_url)
    victim.start_stream(callback=lambda result, error: responses.put(error))
    victim.async_stream_infer(model, omni_inputs(grpcclient, {
        "text_input": "tell a long story", "stream": True,
        "sampling_parameters": '{"max_tokens": 1000, "ignore_eos": true}'}))
    assert responses.get(timeout=60) is None  # under way

    results: list = []
    others = [threading.Thread(target=lambda i=i: results.append(text(grpc_url, model, i))) for i in range(3)]
    for thread in others:
        thread.start()
    victim.stop_stream(cancel_requests=True)  # while the others are being generated
    victim.close()
    for thread in others:
        thread.join(timeout=120)
    assert sorted(results) == sorted(text(grpc_url, model, i) for i in range(3))
