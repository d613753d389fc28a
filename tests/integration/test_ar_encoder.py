"""`ar_encoder`: per-token hidden states for diffusion conditioning."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from transformers import AutoTokenizer
from triton_omni.demo_models import AR_SHAPE, resolve_model
from triton_omni_client import OmniClient

from tests.support.server import ENCODE_MODELS

PROMPTS = ["a red fox", "an astronaut rides a horse on the moon", "watercolor", "a robot reads a book"]


def num_tokens(prompt: str) -> int:
    return len(AutoTokenizer.from_pretrained(resolve_model("demo:tiny-qwen2"))(prompt)["input_ids"])


@pytest.mark.parametrize("model", ENCODE_MODELS)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_shape_dtype_and_non_empty_bytes(server, model, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    embeds = OmniClient(url, protocol).encode(PROMPTS[1], model=model)
    assert embeds.shape == (num_tokens(PROMPTS[1]), AR_SHAPE["hidden_size"])
    assert embeds.dtype == np.float32
    assert embeds.nbytes > 0 and np.isfinite(embeds).all() and np.abs(embeds).sum() > 0


@pytest.mark.parametrize("model", ENCODE_MODELS)
def test_mask_matches_tokens(http_url, model):
    with httpclient.InferenceServerClient(http_url) as client:
        t = httpclient.InferInput("text_input", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[PROMPTS[0].encode()]], dtype=np.object_))
        result = client.infer(model, [t])
    mask = result.as_numpy("prompt_embeds_mask")
    assert mask.dtype == np.int32
    assert mask.shape == (1, num_tokens(PROMPTS[0])) and (mask == 1).all()


@pytest.mark.parametrize("model", ENCODE_MODELS)
def test_batched_requests_each_get_their_own_embeddings(grpc_url, model):
    client = OmniClient(grpc_url)
    alone = [client.encode(p, model=model) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        together = list(pool.map(lambda p: client.encode(p, model=model), PROMPTS * 2))
    for i, embeds in enumerate(together):
        np.testing.assert_allclose(embeds, alone[i % len(PROMPTS)], rtol=1e-4, atol=1e-4)


def test_dynamic_batching_merges_concurrent_requests(http_url):
    """The transformers engine encodes Triton's batches (on vLLM, ``ar_encoder``
    hands each request to the engine, which batches at every step)."""
    model = "ar_encoder_transformers"

    def counts():
        with httpclient.InferenceServerClient(http_url) as client:
            stats = client.get_inference_statistics(model)["model_stats"][0]
        return stats["inference_count"], stats["execution_count"]

    def settled():
        """The previous test's last requests may not be counted yet (Triton counts a request after
        its response): statistics that have stopped moving (once, CI read 33 for 32)."""
        last = counts()
        while True:
            time.sleep(0.3)
            now = counts()
            if now == last:
                return now
            last = now

    inferences_before, executions_before = settled()
    # 32 clients, connected and with their request built, released at once: with no
    # batching window (the default), requests merge when they queue behind a running batch.
    release = threading.Barrier(32)

    def one(i: int) -> int:
        with httpclient.InferenceServerClient(http_url) as client:
            t = httpclient.InferInput("text_input", [1, 1], "BYTES")
            t.set_data_from_numpy(np.array([[PROMPTS[i % len(PROMPTS)].encode()]], dtype=np.object_))
            client.is_server_live()
            release.wait(timeout=60)
            return client.infer(model, [t]).as_numpy("prompt_embeds").size

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert all(size > 0 for size in pool.map(one, range(32)))
    # Triton counts a request in its statistics after sending the response: wait for the last one.
    deadline = time.monotonic() + 10
    while (inferences := counts()[0]) - inferences_before < 32 and time.monotonic() < deadline:
        time.sleep(0.05)
    inferences, executions = counts()
    # a straggler of an earlier test counted after `settled` adds to both counts alike
    assert inferences - inferences_before >= 32
    assert executions - executions_before < inferences - inferences_before, "no request was batched with another"


def test_engines_agree(grpc_url):
    """vLLM's token_embed pooling and transformers' last hidden states are the same tensor."""
    client = OmniClient(grpc_url)
    vllm_embeds = client.encode(PROMPTS[1], model="ar_encoder")
    hf_embeds = client.encode(PROMPTS[1], model="ar_encoder_transformers")
    np.testing.assert_allclose(vllm_embeds, hf_embeds, rtol=1e-3, atol=1e-3)
