"""Bad inputs get INVALID_ARG naming the parameter; the server keeps serving."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from triton_omni_client import OmniClient, OmniError
from triton_omni_client.client import stream_infer
from tritonclient.utils import InferenceServerException

from tests.support.server import ENCODE_MODELS, GENERATE_MODELS


def tensor(name, value, type_name, dtype):
    t = grpcclient.InferInput(name, [len(value)], type_name)
    t.set_data_from_numpy(np.array(value, dtype=dtype))
    return t


def text(value=b"hello"):
    return tensor("text_input", [value], "BYTES", np.object_)


def flag(name, value=True):
    return tensor(name, [value], "BOOL", np.bool_)


def sampling(values):
    raw = values if isinstance(values, str) else json.dumps(values)
    return tensor("sampling_parameters", [raw.encode()], "BYTES", np.object_)


LONG_PROMPT = " ".join(f"w{i}" for i in range(1500)).encode()  # > 1023 tokens, < max_prompt_chars

BAD_INPUTS = {
    "missing text_input": ([tensor("max_tokens", [4], "INT32", np.int32)], "text_input"),
    "empty prompt": ([text(b"")], "text_input"),
    "blank prompt": ([text(b"   ")], "text_input"),
    "invalid utf-8": ([text(b"\xff\xfe")], "text_input"),
    "prompt too long": ([text(LONG_PROMPT)], "text_input"),
    "max_tokens 0": ([text(), tensor("max_tokens", [0], "INT32", np.int32)], "max_tokens"),
    "max_tokens huge": ([text(), tensor("max_tokens", [10**6], "INT32", np.int32)], "max_tokens"),
    "temperature < 0": ([text(), tensor("temperature", [-0.5], "FP32", np.float32)], "temperature"),
    "temperature NaN": ([text(), tensor("temperature", [np.nan], "FP32", np.float32)], "temperature"),
    "top_p > 1": ([text(), tensor("top_p", [1.5], "FP32", np.float32)], "top_p"),
    "malformed JSON": ([text(), sampling("{max_tokens: 3")], "sampling_parameters"),
    "unknown key": ([text(), sampling({"frobnicate": 3})], "frobnicate"),
    "typo key": ([text(), sampling({"max_token": 3})], "max_token"),
    "removed key best_of": ([text(), sampling({"best_of": 3})], "best_of"),
    "an adapter the model lacks, as lora_name": ([text(), sampling({"lora_name": "x"})], "lora_name"),
    "prompt_logprobs": ([text(), sampling({"prompt_logprobs": 1})], "prompt_logprobs"),
    "string that is not a number": ([text(), sampling({"temperature": "0.1x"})], "temperature"),
    "string that is not a boolean": ([text(), sampling({"ignore_eos": "yes please"})], "ignore_eos"),
    "n too large": ([text(), sampling({"n": 64})], "n"),
    "n zero": ([text(), sampling({"n": "0"})], "n"),
    "stop_token_ids not ints": ([text(), sampling({"stop_token_ids": ["a"]})], "stop_token_ids"),
    "stop_token_ids not a list": ([text(), sampling({"stop_token_ids": 5})], "stop_token_ids"),
    "logprobs beyond the limit": ([text(), sampling({"logprobs": 50}), flag("return_logprobs")], "logprobs"),
    "logprobs without return_logprobs": ([text(), sampling({"logprobs": 1})], "logprobs"),
    "presence_penalty out of range": ([text(), sampling({"presence_penalty": "3"})], "presence_penalty"),
    "min_p out of range": ([text(), sampling({"min_p": 1.5})], "min_p"),
    "seed beyond int64": ([text(), sampling({"seed": 2**64})], "seed"),
    "logit_bias not an object": ([text(), sampling({"logit_bias": [1, 2]})], "logit_bias"),
    "JSON nested too deeply": ([text(), sampling("[" * 100_000 + "]" * 100_000)], "sampling_parameters"),
    "streaming with exclude false": ([text(), flag("stream"), flag("exclude_input_in_output", False)],
                                     "exclude_input_in_output"),
    "parameters contradict the input": ([text(), sampling({"max_tokens": 3})], "sampling_parameters",
                                        {"max_tokens": 4}),
    "wrong JSON type": ([text(), sampling({"temperature": "hot"})], "temperature"),
    "wrong dtype": ([text(), tensor("temperature", [0.5], "FP64", np.float64)], "temperature"),
    "two prompts": ([tensor("text_input", [b"a", b"b"], "BYTES", np.object_)], "text_input"),
}


@pytest.mark.parametrize("model", GENERATE_MODELS)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_invalid_arg_and_server_keeps_serving(grpc_url, model, case):
    inputs, parameter, *request_parameters = BAD_INPUTS[case]
    with pytest.raises(OmniError) as info:
        list(stream_infer(grpc_url, model, inputs, parameters=request_parameters[0] if request_parameters else None))
    assert info.value.status == "INVALID_ARG", info.value
    assert parameter in str(info.value)
    chunks = list(OmniClient(grpc_url).generate_text("still serving", model=model, max_tokens=3))
    assert chunks[-1].finish_reason in ("length", "stop")


@pytest.mark.parametrize("model", GENERATE_MODELS)
@pytest.mark.parametrize(("body", "parameter"), [
    ({"max_token": 3}, "max_token"),
    ({"parameters": {"temprature": 0.5}}, "temprature"),
    ({"n": "lots"}, "n"),
])
def test_http_generate_bad_keys_are_invalid_arg(http_url, model, body, parameter):
    """Keys of a /generate body that are not inputs reach the model as request parameters."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://{http_url}/v2/models/{model}/generate",
                                     data=json.dumps({"text_input": "hello", **body}).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 400
    assert f"`{parameter}`" in json.loads(info.value.read())["error"]
    assert list(OmniClient(http_url, "http").generate_text("still serving", model=model, max_tokens=2))


@pytest.mark.parametrize("model", GENERATE_MODELS)
def test_http_generate_endpoint_reports_invalid_arg(http_url, model):
    with pytest.raises(OmniError) as info:
        list(OmniClient(http_url, "http").generate_text("hello", model=model, top_p=2.0))
    assert info.value.status == "INVALID_ARG"
    assert "top_p" in str(info.value)


@pytest.mark.parametrize("model", ENCODE_MODELS)
def test_encoder_rejects_bad_prompt_alone_in_its_batch(http_url, model):
    """Requests sent together are batched; the bad one fails, the others succeed."""
    prompts = [b"a fox", b"   ", b"a cat", LONG_PROMPT, b"a dog"]
    results = []
    with httpclient.InferenceServerClient(http_url, concurrency=len(prompts)) as client:
        for prompt in prompts:
            t = httpclient.InferInput("text_input", [1, 1], "BYTES")
            t.set_data_from_numpy(np.array([[prompt]], dtype=np.object_))
            results.append(client.async_infer(model, [t]))
        outcomes = []
        for pending in results:
            try:
                outcomes.append(pending.get_result().as_numpy("prompt_embeds"))
            except InferenceServerException as exc:
                outcomes.append(exc)
    for i in (0, 2, 4):
        assert isinstance(outcomes[i], np.ndarray) and outcomes[i].size > 0
    for i in (1, 3):
        assert isinstance(outcomes[i], InferenceServerException)
        assert outcomes[i].status() == "400"  # INVALID_ARG over HTTP
        assert "text_input" in outcomes[i].message()
