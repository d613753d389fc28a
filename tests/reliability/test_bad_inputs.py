"""A corpus of bad inputs against all five models, over HTTP (binary
tensors, and JSON on /generate) and gRPC (unary, and the stream the
decoupled models need). Each case must come back within 30 s as a typed
client error (HTTP 400, gRPC INVALID_ARGUMENT) whose message names the
input at fault, and the server must go on serving: after each model's
cases a valid request to it succeeds.

Typed errors on gRPC *streams* carry no status code (Triton 2.51 sends the
error as a stream message): there the message itself must name the input.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from triton_omni_client.client import batched_inputs, omni_inputs, stream_infer

from tests.support.server import LONG_RELIABILITY as LONG

IMAGE = {"prompt": "a red fox", "num_inference_steps": 1, "height": 32, "width": 32, "guidance_scale": 1.0}
T2I = {"text_input": "a red fox", "negative_prompt": "", "num_inference_steps": 1, "height": 32, "width": 32,
       "guidance_scale": 1.0}
AR = {"text_input": "a red fox", "max_tokens": 4}
OMNI = {"text_input": "a red fox", "modalities": ["text"], "max_tokens": 4}
DEEP = "[" * 5000 + "]" * 5000
HUGE_TEXT = "fox " * 200_000

# A documented exception (docs/operations.md, "Bad input"), Triton's own: a Triton 2.51 ensemble
# does not check its required inputs: one missing ends in its "unexpected deadlock" message (typed
# INVALID_ARG, but naming no input).
TRITON_ENSEMBLE_MISSING = "unexpected deadlock"

# (model, values replaced in its valid request (None: removed), what the error must name)
VALUE_CASES = [
    *[("diffusion", change, name) for change, name in [
        ({"num_inference_steps": 0}, "num_inference_steps"), ({"num_inference_steps": -3}, "num_inference_steps"),
        ({"num_inference_steps": 10**6}, "num_inference_steps"), ({"num_inference_steps": 2**31 - 1},
                                                                   "num_inference_steps"),
        ({"height": 7}, "height"), ({"height": 0}, "height"), ({"height": -64}, "height"),
        ({"height": 2**30}, "height"), ({"width": 33}, "width"), ({"width": 10**6}, "width"),
        ({"guidance_scale": float("nan")}, "guidance_scale"), ({"guidance_scale": float("inf")}, "guidance_scale"),
        ({"negative_prompt": HUGE_TEXT}, "negative_prompt"),
        ({"prompt": None}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": HUGE_TEXT}, "prompt"),
        ({"prompt": None, "prompt_embeds": np.full((4, 128), np.nan, np.float32)}, "prompt_embeds"),
        ({"prompt": None, "prompt_embeds": np.zeros((4, 77), np.float32)}, "prompt_embeds"),
        ({"prompt": None, "prompt_embeds": np.zeros((0, 128), np.float32)}, "prompt_embeds"),
        ({"prompt": None, "prompt_embeds": np.zeros((5000, 128), np.float32)}, "prompt_embeds"),
        ({"negative_prompt_embeds": np.zeros((4, 64), np.float32)}, "negative_prompt_embeds"),
    ]],
    *[("text_to_image", change, name) for change, name in [
        ({"text_input": ""}, "text_input"), ({"text_input": HUGE_TEXT}, "text_input"),
        ({"num_inference_steps": 0}, "num_inference_steps"), ({"num_inference_steps": 10**6}, "num_inference_steps"),
        ({"height": 7}, "height"), ({"width": -8}, "width"), ({"guidance_scale": float("nan")}, "guidance_scale"),
        ({"negative_prompt": HUGE_TEXT}, "negative_prompt"), ({"text_input": None}, TRITON_ENSEMBLE_MISSING),
    ]],
    *[("ar_encoder", change, name) for change, name in [
        ({"text_input": HUGE_TEXT}, "text_input"), ({"text_input": None}, "text_input"),
        ({"text_input": ""}, "text_input"), ({"negative_prompt": HUGE_TEXT}, "negative_prompt"),
    ]],
    *[("ar", change, name) for change, name in [
        ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 10**9}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 2.0}, "top_p"), ({"top_p": -0.5}, "top_p"), ({"top_k": -5}, "top_k"),
        ({"min_tokens": -2}, "min_tokens"), ({"min_p": 2.0}, "min_p"),
        ({"sampling_parameters": "{"}, "sampling_parameters"), ({"sampling_parameters": "[]"}, "sampling_parameters"),
        ({"sampling_parameters": '{"bogus": 1}'}, "bogus"), ({"sampling_parameters": DEEP}, "sampling_parameters"),
        ({"max_tokens": None, "sampling_parameters": '{"max_tokens": "many"}'}, "max_tokens"),
        ({"sampling_parameters": '{"seed": 1e300}'}, "seed"), ({"text_input": None}, "text_input"),
        ({"text_input": HUGE_TEXT}, "text_input"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ]],
    *[("omni", change, name) for change, name in [
        ({"modalities": ["audio"]}, "modalities"), ({"modalities": []}, "modalities"),
        ({"num_images": 0}, "num_images"), ({"num_images": 1000}, "num_images"),
        ({"parameters": "{"}, "parameters"), ({"parameters": DEEP}, "parameters"),
        ({"parameters": '{"seed": 9223372036854775808}'}, "seed"),
        ({"parameters": '{"num_inference_steps": 4294967297}'}, "num_inference_steps"),
        ({"parameters": '{"bogus": true}'}, "bogus"), ({"options": "[1]"}, "options"),
        ({"max_tokens": -4}, "max_tokens"), ({"temperature": float("inf")}, "temperature"),
        ({"modalities": ["image"], "height": 7}, "height"), ({"modalities": ["image"], "num_inference_steps": 0},
                                                              "num_inference_steps"),
        ({"text_input": None}, "text_input"), ({"text_input": HUGE_TEXT}, "text_input"),
    ]],
]
BASE = {"diffusion": IMAGE, "text_to_image": T2I, "ar_encoder": {"text_input": "a red fox"}, "ar": AR, "omni": OMNI}
DECOUPLED = ("ar", "omni")


def values_for(model: str, change: dict) -> dict:
    values = BASE[model] | change
    return {k: v for k, v in values.items() if v is not None}


def send_batched(protocol: str, url: str, model: str, inputs_of) -> None:
    module = grpcclient if protocol == "grpc" else httpclient
    with module.InferenceServerClient(url, **({"network_timeout": 30} if protocol == "http" else {})) as client:
        kwargs = {"client_timeout": 30} if protocol == "grpc" else {}
        client.infer(model, inputs_of(module), **kwargs)


def send_stream(url: str, model: str, inputs_of) -> None:
    list(stream_infer(url, model, inputs_of(grpcclient)))


def send_generate(http_url: str, model: str, values: dict) -> None:
    """HTTP /generate, JSON (the decoupled models' HTTP path). Triton reserves the
    body key `parameters`; `omni` takes the same JSON as `options` there (docs/models.md)."""
    values = {("options" if k == "parameters" else k): v for k, v in values.items()}
    body = json.dumps({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in values.items()},
                      allow_nan=True).encode()
    request = urllib.request.Request(f"http://{http_url}/v2/models/{model}/generate", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def check(error: Exception, name: str, typed: bool = True) -> None:
    text = str(error)
    if isinstance(error, urllib.error.HTTPError):
        text = f"{error.code} {error.read().decode(errors='replace')}"
        assert error.code == 400, text
    elif typed and "StatusCode." in text:
        assert "INVALID_ARGUMENT" in text, text
    elif typed and hasattr(error, "status") and error.status():
        assert error.status() in ("400", "StatusCode.INVALID_ARGUMENT"), text
    assert name in text, f"the error does not name '{name}': {text[:300]}"


def cases():
    protocols = ("grpc", "http")
    for k, (model, change, name) in enumerate(VALUE_CASES):
        for protocol in protocols:
            if LONG or (k + (protocol == "http")) % 2 == 0:  # short: each case once, protocols alternating
                yield pytest.param(model, change, name, protocol, id=f"{model}-{k}-{protocol}")


@pytest.mark.parametrize(("model", "change", "name", "protocol"), list(cases()))
def test_bad_value_is_a_typed_error_naming_it(supervised, model, change, name, protocol):
    values = values_for(model, change)
    url = supervised.grpc_url if protocol == "grpc" else supervised.http_url
    with pytest.raises(Exception) as caught:
        if model in DECOUPLED and protocol == "http":
            send_generate(supervised.http_url, model, values)
        elif model in DECOUPLED:
            send_stream(url, model, lambda module: omni_inputs(module, values))
        else:
            send_batched(protocol, url, model, lambda module: batched_inputs(module, **values))
    if model in DECOUPLED and protocol == "http" and name == "parameters":
        name = "options"  # what the request sent (send_generate)
    check(caught.value, name, typed=not (model in DECOUPLED and protocol == "grpc"))


TYPE_CASES = [  # Triton's own checks: the wrong type, the wrong shape, an input it does not know
    ("seed", "FP32", np.float32, "seed"), ("height", "INT64", np.int64, "height"),
    ("guidance_scale", "INT32", np.int32, "guidance_scale"), ("bogus", "INT32", np.int32, "bogus"),
    ("prompt_embeds", "FP64", np.float64, "prompt_embeds"),  # OmniClient casts; a raw tensor is refused
]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("model", ["diffusion", "text_to_image", "ar_encoder"])
@pytest.mark.parametrize(("input_name", "datatype", "dtype", "name"), TYPE_CASES)
def test_wrong_type_or_unknown_input_is_refused_by_name(supervised, model, protocol, input_name, datatype, dtype,
                                                        name):
    def inputs_of(module):
        tensor = module.InferInput(input_name, [1, 1], datatype)
        tensor.set_data_from_numpy(np.array([[1]], dtype=dtype))
        return [*batched_inputs(module, **BASE[model]), tensor]

    url = supervised.grpc_url if protocol == "grpc" else supervised.http_url
    with pytest.raises(Exception) as caught:
        send_batched(protocol, url, model, inputs_of)
    check(caught.value, name)


@pytest.mark.parametrize("model", list(BASE))
def test_the_model_still_serves_after_its_bad_inputs(supervised, model):
    """Runs after the cases above (pytest keeps file order)."""
    values = values_for(model, {})
    if model in DECOUPLED:
        assert list(stream_infer(supervised.grpc_url, model, omni_inputs(grpcclient, values)))
    else:
        send_batched("grpc", supervised.grpc_url, model, lambda module: batched_inputs(module, **values))
