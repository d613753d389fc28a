"""AR request validation: normalisation, then checks naming parameter and value;
the vLLM backend's request contract (string forms, request parameters,
exclude_input_in_output, return_* flags)."""

import json
import math

import pytest
from triton_omni.ar import ArLimits, EncodeRequest, GenerateRequest
from triton_omni.ar.sampling import REFUSED_KEYS
from triton_omni.errors import RequestValidationError

LIMITS = ArLimits(max_tokens=100, max_prompt_chars=50)


def build(request_parameters=None, **inputs):
    return GenerateRequest.from_inputs({"text_input": "hello", **inputs}, LIMITS, request_parameters)


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
        ({"sampling_parameters": '{"best_of": 2}'}, "best_of"),
        ({"sampling_parameters": '{"max_token": 2}'}, "max_token"),
        ({"sampling_parameters": '{"temperature": "0.1.2"}'}, "temperature"),
        ({"sampling_parameters": '{"n": 5}'}, "n"),
        ({"sampling_parameters": '{"logprobs": 21}', "return_logprobs": True}, "logprobs"),
        ({"sampling_parameters": '{"logprobs": 2}'}, "logprobs"),
        ({"sampling_parameters": '{"stop_token_ids": ["a"]}'}, "stop_token_ids"),
        ({"sampling_parameters": '{"stop_token_ids": 3}'}, "stop_token_ids"),
        ({"sampling_parameters": '{"presence_penalty": 3}'}, "presence_penalty"),
        ({"sampling_parameters": '{"min_p": "2"}'}, "min_p"),
        ({"sampling_parameters": '{"seed": 9223372036854775808}'}, "seed"),
        ({"sampling_parameters": "[" * 100_000 + "]" * 100_000}, "sampling_parameters"),
        ({"stream": True, "exclude_input_in_output": False}, "exclude_input_in_output"),
        ({"return_logprobs": "sometimes"}, "return_logprobs"),
        ({"sampling_parameters": '{"temperature": "hot"}'}, "temperature"),
        ({"sampling_parameters": '{"max_tokens": 2.5}'}, "max_tokens"),
        ({"sampling_parameters": '{"ignore_eos": "maybe"}'}, "ignore_eos"),
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


def test_the_encoder_s_negative_prompt_is_a_text_as_sent_and_absent_is_not_empty():
    """"" and " " are negative prompts the family's pipeline encodes; absent is asked for by output."""
    assert EncodeRequest.from_inputs({"text_input": "a fox"}, LIMITS) == EncodeRequest("a fox")
    for text in ("", " ", "blurry"):
        assert EncodeRequest.from_inputs({"text_input": "a fox", "negative_prompt": text}, LIMITS) == \
            EncodeRequest("a fox", text, with_negative=True)
    assert EncodeRequest.from_inputs({"text_input": "a fox"}, LIMITS, negative_wanted=True) == \
        EncodeRequest("a fox", None, with_negative=True)
    with pytest.raises(RequestValidationError, match="text_input"):
        EncodeRequest.from_inputs({}, LIMITS)
    for prompt in ("", "  "):
        with pytest.raises(RequestValidationError, match="text_input"):
            EncodeRequest.from_inputs({"text_input": prompt, "negative_prompt": " "}, LIMITS)
    with pytest.raises(RequestValidationError, match="negative_prompt"):
        EncodeRequest.from_inputs({"text_input": "a fox", "negative_prompt": "x" * (LIMITS.max_prompt_chars + 1)},
                                  LIMITS)


def test_message_echoes_value():
    with pytest.raises(RequestValidationError, match=r"got -3\.0"):
        build(temperature=-3.0)


def test_numbers_and_booleans_in_their_string_forms():
    """What Triton's vLLM backend sample client and genai-perf --backend vllm send."""
    request = build(sampling_parameters=json.dumps(
        {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100", "ignore_eos": "false", "seed": "7"}))
    assert request.sampling.temperature == 0.1
    assert request.sampling.top_p == 0.95
    assert request.sampling.max_tokens == 100
    assert request.sampling.ignore_eos is False  # bool("false") would be True
    assert request.sampling.seed == 7


def test_request_parameters_when_there_is_no_sampling_parameters_input():
    request = build({"max_tokens": 3, "temperature": "0"})
    assert request.sampling.max_tokens == 3
    assert request.sampling.temperature == 0.0


def test_request_parameters_may_repeat_the_input_but_not_contradict_it():
    same = {"max_tokens": "5"}
    assert build(same, sampling_parameters=json.dumps(same)).sampling.max_tokens == 5
    with pytest.raises(RequestValidationError, match="max_tokens"):
        build({"max_tokens": "6"}, sampling_parameters=json.dumps(same))
    with pytest.raises(RequestValidationError, match="top_k"):
        build({"top_k": 2}, sampling_parameters=json.dumps(same))


def test_typo_names_the_key_and_suggests_the_right_one():
    with pytest.raises(RequestValidationError, match="did you mean 'max_tokens'"):
        build({"max_token": 3})


@pytest.mark.parametrize("key", sorted(REFUSED_KEYS))
def test_refused_keys_say_why(key):
    with pytest.raises(RequestValidationError) as info:
        build({key: 1})
    assert info.value.parameter == key
    assert REFUSED_KEYS[key] in str(info.value)


def test_tensorrt_llm_tensor_names():
    request = build(stop_words=["END"], min_length=4, max_tokens=8, frequency_penalty=0.5, presence_penalty=0.25)
    assert request.sampling.stop == ["END"]
    assert request.sampling.min_tokens == 4
    assert (request.sampling.frequency_penalty, request.sampling.presence_penalty) == (0.5, 0.25)


def test_exclude_input_in_output_defaults_follow_the_vllm_backend():
    assert build().include_prompt is True
    assert build(stream=True).include_prompt is False
    assert build(exclude_input_in_output=True).include_prompt is False
    assert build(exclude_input_in_output=False).include_prompt is True


def test_return_flags_and_changed_keys():
    request = build(return_finish_reason=True, return_num_input_tokens="true", sampling_parameters=json.dumps(
        {"logprobs": 2, "n": 2, "top_p": 1.0}), return_logprobs=True)
    assert request.outputs.finish_reason and request.outputs.num_input_tokens and request.outputs.logprobs
    assert not request.outputs.cumulative_logprob and request.outputs.needs_logprobs
    assert request.sampling.changed_keys() == ["n", "logprobs"]  # top_p at its default changes nothing

