"""`ar` driven the ways Triton's vLLM backend's own clients and tests drive it.

The requests here are shaped like those of vllm_backend's ``samples/client.py``
(gRPC aio stream, ``sampling_parameters`` with numbers as strings, the same
options again as request parameters), its README's ``/generate`` call
(options in ``parameters``), its additional-outputs test (every ``return_*``
combination, streaming and not) and Triton's OpenAI frontend (TensorRT-LLM
tensor names). Tests that need log probabilities or ``n > 1`` run on vLLM
only: the transformers engine refuses them by name (tested too).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from transformers import AutoTokenizer
from triton_omni.demo_models import resolve_model
from triton_omni_client import OmniError
from triton_omni_client.client import stream_infer
from triton_omni_protocol import RETURN_FLAGS

from tests.support.server import GENERATE_MODELS


def tensor(module, name, values, type_name, dtype):
    t = module.InferInput(name, [len(values)], type_name)
    t.set_data_from_numpy(np.array(values, dtype=dtype))
    return t


def request_inputs(module=grpcclient, prompt="A red fox", stream=False, sampling=None, **flags):
    inputs = [tensor(module, "text_input", [prompt.encode()], "BYTES", np.object_),
              tensor(module, "stream", [stream], "BOOL", bool)]
    if sampling is not None:
        inputs.append(tensor(module, "sampling_parameters", [json.dumps(sampling).encode()], "BYTES", np.object_))
    inputs += [tensor(module, name, [value], "BOOL", bool) for name, value in flags.items()]
    return inputs


def responses(url, model, inputs, **kwargs):
    return [{o.name: r.as_numpy(o.name) for o in r.get_response().outputs}
            for r in stream_infer(url, model, inputs, **kwargs)]


# -- the vLLM backend's sample client ------------------------------------------------


async def sample_client_requests(url, model, prompts):
    """What vllm_backend's samples/client.py does (non-streaming mode), request for request."""
    sampling_parameters = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "12"}
    results: dict[str, list[str]] = {}

    async def requests():
        for i, prompt in enumerate(prompts):
            yield {"model_name": model, "inputs": request_inputs(aioclient, prompt, False, sampling_parameters),
                   "outputs": [aioclient.InferRequestedOutput("text_output")], "request_id": str(i),
                   "parameters": sampling_parameters}

    async with aioclient.InferenceServerClient(url) as client:
        async for result, error in client.stream_infer(inputs_iterator=requests(), stream_timeout=120):
            assert error is None, error
            results.setdefault(result.get_response().id, []).extend(
                t.decode() for t in result.as_numpy("text_output"))
            if len(results) == len(prompts):
                break
    return results


@pytest.mark.parametrize("model", GENERATE_MODELS)
def test_the_vllm_backend_sample_client_gets_text_for_every_prompt(grpc_url, model):
    prompts = ["What is Triton?", "Say hello", "Count to three"]
    results = asyncio.run(sample_client_requests(grpc_url, model, prompts))
    for i, prompt in enumerate(prompts):
        (text,) = results[str(i)]
        assert text.startswith(prompt) and len(text) > len(prompt)  # not streaming: the prompt comes first


# -- where sampling options come from ---------------------------------------------------


@pytest.mark.parametrize("model", GENERATE_MODELS)
def test_options_only_as_request_parameters_are_honoured(grpc_url, model):
    counts = []
    for max_tokens in (3, "5"):  # a number, and its string form
        (last,) = responses(grpc_url, model, request_inputs(return_num_output_tokens=True),
                            parameters={"max_tokens": max_tokens, "ignore_eos": "true"})
        counts.append(int(last["num_output_tokens"][0]))
    assert counts == [3, 5]


@pytest.mark.parametrize("model", GENERATE_MODELS)
def test_http_generate_takes_options_in_parameters_as_the_vllm_backend_readme_shows(http_url, model):
    body = {"text_input": "What is Triton?", "parameters": {"stream": False, "temperature": 0,
                                                            "exclude_input_in_output": True, "max_tokens": 4,
                                                            "ignore_eos": True, "return_num_output_tokens": True}}
    result = post_generate(http_url, model, body)
    assert result["num_output_tokens"] == 4
    assert not result["text_output"].startswith("What is Triton?")


def post_generate(http_url, model, body):
    request = urllib.request.Request(f"http://{http_url}/v2/models/{model}/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


@pytest.mark.parametrize("model", GENERATE_MODELS)
def test_tensorrt_llm_tensor_names(grpc_url, model):
    """What Triton's OpenAI frontend and genai-perf --backend tensorrtllm send."""
    inputs = request_inputs(exclude_input_in_output=True, return_num_input_tokens=True,
                            return_num_output_tokens=True)
    inputs += [tensor(grpcclient, "max_tokens", [6], "INT32", np.int32),
               tensor(grpcclient, "min_length", [6], "INT32", np.int32),
               tensor(grpcclient, "stop_words", [b"never-generated-stop"], "BYTES", np.object_)]
    (result,) = responses(grpc_url, model, inputs)
    assert int(result["num_output_tokens"][0]) == 6
    assert int(result["num_input_tokens"][0]) > 0


# -- additional outputs --------------------------------------------------------------------


def flag_combinations(model):
    # heard_states, thinker_states: a thinker's states, which the transformers engine hands on
    # (tests/integration/test_speech.py, test_speech_qwen25.py); vLLM refuses them by name (below)
    flags = tuple(f for f in RETURN_FLAGS if f not in ("heard_states", "thinker_states")) if model == "ar" \
        else ("finish_reason", "num_input_tokens", "num_output_tokens")
    return [dict(zip(flags, values, strict=True)) for values in itertools.product([False, True], repeat=len(flags))]


@pytest.mark.parametrize("model", GENERATE_MODELS)
@pytest.mark.parametrize("stream", [False, True])
def test_every_return_combination_sends_exactly_the_outputs_asked_for(grpc_url, model, stream):
    for combination in flag_combinations(model):
        flags = {f"return_{name}": value for name, value in combination.items()}
        got = responses(grpc_url, model, request_inputs(stream=stream, sampling={"max_tokens": 5, "ignore_eos": True},
                                                        **flags))
        asked = {name for name, on in combination.items() if on}  # return_<name> switches output <name>
        for i, outputs in enumerate(got):
            expected = {"text_output"} | (asked if i == len(got) - 1 else asked - {"finish_reason"})
            assert set(outputs) == expected, (combination, i)
        # (Streaming itself: test_ar_generate. Here five quick tokens may merge into one response
        # while the response thread is busy, by design: responses.py; seen on a loaded CI machine.)
        if combination.get("num_output_tokens"):
            assert sum(int(o["num_output_tokens"][0]) for o in got) == 5  # per response, as the vLLM backend
        if combination.get("finish_reason"):
            assert got[-1]["finish_reason"].tolist() == [b"length"]


@pytest.mark.parametrize("flag", ["heard_states", "thinker_states"])
def test_the_vllm_engine_refuses_to_hand_on_hidden_states_by_name(grpc_url, flag):
    with pytest.raises(OmniError, match=f"return_{flag}") as error:
        responses(grpc_url, "ar", request_inputs(stream=True, sampling={"max_tokens": 2}, **{f"return_{flag}": True}))
    assert error.value.status == "INVALID_ARG"


def test_logprobs_are_a_list_of_dicts_per_token_whose_rank_1_tokens_spell_the_text(grpc_url):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("demo:tiny-qwen2"))
    got = responses(grpc_url, "ar", request_inputs(
        stream=True, sampling={"max_tokens": 8, "temperature": 0, "logprobs": 2, "ignore_eos": True},
        return_logprobs=True, return_cumulative_logprob=True, return_num_output_tokens=True))
    cumulative, token_ids, text = [], [], ""
    for outputs in got:
        positions = json.loads(outputs["logprobs"][0])
        assert isinstance(positions, list) and len(positions) == int(outputs["num_output_tokens"][0])
        for position in positions:
            assert 1 <= len(position) <= 3  # the sampled token and the top 2
            (best,) = [int(t) for t, entry in position.items() if entry["rank"] == 1]
            assert position[str(best)]["logprob"] == max(e["logprob"] for e in position.values())
            token_ids.append(best)  # greedy: the sampled token is the top one
        cumulative.append(float(outputs["cumulative_logprob"][0]))
        text += outputs["text_output"][0].decode()
    assert len(token_ids) == 8
    assert tokenizer.decode(token_ids) == text
    assert all(later < earlier for earlier, later in itertools.pairwise(cumulative))  # changes per response


def test_n_completions_on_vllm(grpc_url):
    (result,) = responses(grpc_url, "ar", request_inputs(
        sampling={"n": "2", "max_tokens": 4, "seed": 3, "ignore_eos": True},
        return_finish_reason=True, return_num_output_tokens=True, exclude_input_in_output=True))
    assert len(result["text_output"]) == 2
    assert result["num_output_tokens"].tolist() == [4, 4]
    assert result["finish_reason"].tolist() == [b"length", b"length"]


@pytest.mark.parametrize(("sampling", "flags", "parameter"), [
    ({"n": 2}, {}, "n"),
    ({"presence_penalty": 0.5}, {}, "presence_penalty"),
    ({"logprobs": 1}, {"return_logprobs": True}, "logprobs"),
    ({}, {"return_cumulative_logprob": True}, "return_logprobs"),
])
def test_the_transformers_engine_refuses_what_it_lacks_by_name(grpc_url, sampling, flags, parameter):
    with pytest.raises(OmniError) as info:
        responses(grpc_url, "ar_transformers", request_inputs(sampling=sampling, **flags))
    assert info.value.status == "INVALID_ARG"
    assert f"`{parameter}`" in str(info.value) and "transformers engine" in str(info.value)


# -- exclude_input_in_output -----------------------------------------------------------------


@pytest.mark.parametrize("model", GENERATE_MODELS)
def test_exclude_input_in_output_semantics(grpc_url, model):
    sampling = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    default, excluded, included = (
        responses(grpc_url, model, request_inputs(sampling=sampling, **flags))[0]["text_output"][0].decode()
        for flags in ({}, {"exclude_input_in_output": True}, {"exclude_input_in_output": False}))
    assert default == included == "A red fox" + excluded
    streamed = responses(grpc_url, model, request_inputs(stream=True, sampling=sampling))
    assert "".join(o["text_output"][0].decode() for o in streamed) == excluded  # streaming excludes by default
    with pytest.raises(OmniError, match="exclude_input_in_output") as info:
        responses(grpc_url, model, request_inputs(stream=True, sampling=sampling, exclude_input_in_output=False))
    assert info.value.status == "INVALID_ARG"


# -- cancellation -------------------------------------------------------------------------------


@pytest.mark.parametrize("model", GENERATE_MODELS)
def test_stop_stream_with_cancel_requests_gives_cancelled(grpc_url, model):
    import queue

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, request_inputs(stream=True, sampling={"max_tokens": 1000, "ignore_eos": True}))
    assert results.get(timeout=60)[1] is None  # under way
    client.stop_stream(cancel_requests=True)
    client.close()
    errors = []
    while not results.empty():
        errors.append(results.get()[1])
    assert any(e is not None and str(e.status()) == "StatusCode.CANCELLED" for e in errors), errors


def test_a_typo_on_http_generate_is_http_400_naming_the_key(http_url):
    with pytest.raises(urllib.error.HTTPError) as info:
        post_generate(http_url, "ar", {"text_input": "hi", "max_token": 3})
    assert info.value.code == 400
    assert "max_token" in json.loads(info.value.read())["error"]
