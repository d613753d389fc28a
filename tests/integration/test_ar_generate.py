"""The `ar` model on a real server; every test runs on both engines."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_omni_client import OmniClient
from triton_omni_client.client import stream_infer

from tests.support.server import GENERATE_MODELS

pytestmark = pytest.mark.parametrize("model", GENERATE_MODELS)


def generate(url, protocol, model, prompt="A red fox", **options):
    chunks = list(OmniClient(url, protocol).generate_text(prompt, model=model, **options))
    return chunks


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_generates_text(server, model, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    chunks = generate(url, protocol, model, max_tokens=8, return_num_output_tokens=True,
                      exclude_input_in_output=True, temperature=0.0, sampling_parameters={"ignore_eos": True})
    assert len(chunks) == 1
    assert chunks[0].text
    assert chunks[0].finish_reason == "length"
    assert chunks[0].num_output_tokens == 8


def test_non_streaming_includes_prompt_unless_excluded(grpc_url, model):
    full = generate(grpc_url, "grpc", model, max_tokens=4, seed=1)[0].text
    only_new = generate(grpc_url, "grpc", model, max_tokens=4, seed=1, exclude_input_in_output=True)[0].text
    assert full == "A red fox" + only_new


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_streaming_yields_several_responses_and_ends_final(server, model, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    # (32 tokens: on a busy host a stream's quick tokens merge into fewer responses, by design)
    chunks = generate(url, protocol, model, stream=True, max_tokens=32, seed=3,
                      sampling_parameters={"ignore_eos": True}, return_num_output_tokens=True)
    assert len(chunks) >= 2
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length"
    assert sum(c.num_output_tokens for c in chunks) == 32  # each response counts its new tokens
    streamed = "".join(c.text for c in chunks)
    whole = generate(url, protocol, model, max_tokens=32, seed=3, exclude_input_in_output=True,
                     sampling_parameters={"ignore_eos": True})[0].text
    assert streamed == whole


def test_grpc_stream_last_response_carries_final_flag(grpc_url, model):
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    # (32 tokens: on a busy host a stream's quick tokens merge into fewer responses, by design)
    params.set_data_from_numpy(np.array([json.dumps({"max_tokens": 32, "ignore_eos": True}).encode()],
                                        dtype=np.object_))
    results = list(stream_infer(grpc_url, model, [text, stream, params]))
    flags = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert len(results) >= 2
    assert flags[-1] is True and not any(flags[:-1])


def test_same_seed_same_text_different_seed_different_text(grpc_url, model):
    def sample(seed):
        return generate(grpc_url, "grpc", model, max_tokens=24, temperature=1.0, seed=seed,
                        exclude_input_in_output=True, sampling_parameters={"ignore_eos": True})[0].text

    first, again, other = sample(11), sample(11), sample(12)
    assert first == again
    assert first != other


def test_json_form_equals_tensor_form(grpc_url, model):
    by_tensor = generate(grpc_url, "grpc", model, max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=5,
                         exclude_input_in_output=True)[0]
    by_json = generate(grpc_url, "grpc", model, exclude_input_in_output=True, sampling_parameters={
        "max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 5})[0]
    assert by_tensor.text == by_json.text


def test_stop_string_ends_generation(grpc_url, model):
    text = generate(grpc_url, "grpc", model, max_tokens=40, temperature=0.0, exclude_input_in_output=True,
                    sampling_parameters={"ignore_eos": True})[0].text
    assert len(text) > 4
    stop = text[2:4]
    chunk = generate(grpc_url, "grpc", model, max_tokens=40, temperature=0.0, exclude_input_in_output=True,
                     stop=[stop], sampling_parameters={"ignore_eos": True})[0]
    assert stop not in chunk.text
    assert text.startswith(chunk.text)
    assert chunk.finish_reason == "stop"
