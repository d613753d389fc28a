"""AR request validation: normalisation, then checks naming parameter and value."""

import json
import math

import pytest
from triton_omni.ar import ArLimits, EncodeRequest, GenerateRequest
from triton_omni.errors import RequestValidationError

LIMITS = ArLimits(max_tokens=100, max_prompt_chars=50)


def build(**inputs):
    return GenerateRequest.from_inputs({"text_input": "hello", **inputs}, LIMITS)


def test_defaults():
    request = build()
    assert request.prompt == "hello"
    assert request.sampling.max_tokens == 16
    assert request.stream is False


def test_json_and_tensor_forms_merge_and_tensor_wins():
    request = build(sampling_parameters=json.dumps({"temperature": 0.5, "max_tokens": 7, "stop": "x"}),
                    max_tokens=9)
    assert request.sampling.temperature == 0.5
    assert request.sampling.max_tokens == 9
    assert request.sampling.stop == ["x"]


def test_normalisation():
    request = build(seed=-1, top_k=-1)
    assert request.sampling.seed is None
    assert request.sampling.top_k == 0


@pytest.mark.parametrize(
    ("inputs", "parameter"),
    [
        ({"text_input": ""}, "text_input"),
        ({"text_input": "   "}, "text_input"),
        ({"text_input": "x" * 51}, "text_input"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 101}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"sampling_parameters": "{not json"}, "sampling_parameters"),
        ({"sampling_parameters": "[1, 2]"}, "sampling_parameters"),
        ({"sampling_parameters": '{"best_of": 2}'}, "sampling_parameters"),
        ({"sampling_parameters": '{"temperature": "hot"}'}, "temperature"),
        ({"sampling_parameters": '{"max_tokens": 2.5}'}, "max_tokens"),
        ({"sampling_parameters": '{"ignore_eos": 1}'}, "ignore_eos"),
        ({"sampling_parameters": '{"stop": [1]}'}, "stop"),
        ({"sampling_parameters": '{"min_tokens": 20}'}, "min_tokens"),
    ],
)
def test_bad_values_name_the_parameter(inputs, parameter):
    with pytest.raises(RequestValidationError) as info:
        build(**inputs)
    assert info.value.parameter == parameter
    assert f"`{parameter}`" in str(info.value)


def test_missing_prompt():
    with pytest.raises(RequestValidationError, match="text_input"):
        GenerateRequest.from_inputs({}, LIMITS)


def test_encoder_empty_text_encodes_nothing_but_blank_text_is_an_error():
    """The ensemble's "no negative prompt" reaches ar_encoder as ""."""
    assert EncodeRequest.from_inputs({"text_input": ""}, LIMITS).prompt is None
    with pytest.raises(RequestValidationError, match="text_input"):
        EncodeRequest.from_inputs({}, LIMITS)
    with pytest.raises(RequestValidationError, match="text_input"):
        EncodeRequest.from_inputs({"text_input": "  "}, LIMITS)


def test_message_echoes_value():
    with pytest.raises(RequestValidationError, match=r"got -3\.0"):
        build(temperature=-3.0)
