"""The OpenAI-compatible gateway, driven by the `openai` SDK (sync and async) and by raw HTTP.

Its answers equal Triton's own for the same request (an image from
`text_to_image` over gRPC, a completion from `ar`), its errors are OpenAI's
typed errors naming the field, and a client that goes away cancels its
request in the model.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from triton_omni_client import OmniClient
from triton_omni_tools.gateway import Gateway, text_model_tokenizers
from triton_omni_tools.launcher import free_port

from tests.support.server import children, documented_metrics, metric_value, text_to_image

ROOT = Path(__file__).resolve().parents[2]

FAST = {"num_inference_steps": 2}
KEY = "sk-test-gateway"


@pytest.fixture
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)


def decoded(image: openai.types.Image) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(image.b64_json))).convert("RGB"))


def levels(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


# -- images

def test_images_equal_triton_s_own_for_the_same_seeds(client, server):
    response = client.images.generate(model="text_to_image", prompt="a red fox", n=2, size="32x32",
                                      response_format="b64_json", extra_body={"seed": 7, **FAST})
    images = [decoded(image) for image in response.data]
    assert [image.shape for image in images] == [(32, 32, 3)] * 2
    for i, image in enumerate(images):  # image i is seed + i; step-batched side by side: within a level
        direct = text_to_image(server.grpc_url, "grpc", "a red fox", seed=7 + i, height=32, width=32, **FAST)
        assert levels(image, direct) <= 1


@pytest.mark.parametrize("model", ["omni", "diffusion"])
def test_every_image_model_answers(client, model):
    response = client.images.generate(model=model, prompt="a red fox", n=2, size="48x32",
                                      extra_body={"seed": 1, "guidance_scale": 1.0, "step_cache": "off", **FAST})
    assert [decoded(image).shape for image in response.data] == [(32, 48, 3)] * 2


def test_omni_images_equal_text_to_image_s(client):
    def one(model):
        response = client.images.generate(model=model, prompt="a red fox", size="32x32", extra_body={"seed": 3, **FAST})
        return decoded(response.data[0])

    assert levels(one("omni"), one("text_to_image")) <= 1


# -- text

def test_a_completion_equals_the_ar_model_s(client, server):
    response = client.completions.create(model="ar", prompt="hello there", max_tokens=8, seed=11)
    [direct] = OmniClient(server.grpc_url).generate_text("hello there", max_tokens=8, seed=11,
                                                         exclude_input_in_output=True)
    assert response.choices[0].text == direct.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 8 and response.usage.prompt_tokens > 0


PROMPTS = ["hello there", "a red fox", "once upon a time"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_several_prompts_give_each_prompt_s_own_completions(client, stream):
    """A list of prompts: each prompt's ``n`` completions, prompt i's at choices ``i * n`` on, equal to
    what that prompt alone gets; the usage adds up the prompts'. Streamed, each choice's chunks join
    into the same text and end with one finish reason."""
    options = {"model": "ar", "max_tokens": 5, "n": 2, "seed": 4, "echo": True}
    alone = [client.completions.create(prompt=prompt, **options) for prompt in PROMPTS]
    expected = [choice.text for response in alone for choice in response.choices]
    assert len(set(expected)) == len(expected)  # the prompts and the choices all differ: a mix-up shows
    if not stream:
        response = client.completions.create(prompt=PROMPTS, **options)
        assert [c.index for c in response.choices] == list(range(6))
        assert [c.text for c in response.choices] == expected
        usage = response.usage
    else:
        texts, reasons, usage = [""] * 6, [[] for _ in range(6)], None
        for chunk in client.completions.create(prompt=PROMPTS, stream=True, stream_options={"include_usage": True},
                                               **options):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] += [choice.finish_reason] if choice.finish_reason else []
        assert texts == expected and reasons == [["length"]] * 6
    assert usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert usage.completion_tokens == sum(r.usage.completion_tokens for r in alone) == 30


def test_a_prompt_the_model_refuses_among_several_refuses_the_request_by_name(client):
    too_long = "x " * 20_000  # past the demo model's context
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            response = client.completions.create(model="ar", prompt=["hello", too_long], max_tokens=4, stream=stream)
            list(response) if stream else None
        assert "prompt" in refused.value.message
    # (ignore_eos: sampled, the tiny model's first token is its end of text about one time in 700)
    assert client.completions.create(model="ar", prompt=["hello", "there"], max_tokens=2,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 4


def test_what_clients_send_by_default_is_taken(client):
    """Fields of OpenAI's that ask for nothing, as clients send them (an earlier reply's message sent
    back as it came, with its ``refusal`` and ``annotations``; ``store: false``; no tools): answered."""
    earlier = {"role": "assistant", "content": "hello", "refusal": None, "annotations": [], "audio": None,
               "tool_calls": None, "function_call": None}
    response = client.chat.completions.create(
        model="ar", messages=[{"role": "user", "content": "hi"}, earlier, {"role": "user", "content": "and?"}],
        max_tokens=3, store=False, metadata={"run": "7"}, service_tier="auto", tools=[], tool_choice="none",
        parallel_tool_calls=False, response_format={"type": "text"}, logit_bias={}, user="u-1",
        extra_body={"ignore_eos": True})  # (three tokens whatever the tiny model samples)
    assert response.usage.completion_tokens == 3


def test_a_logit_bias_reaches_the_model(client):
    """OpenAI's ``logit_bias``, vLLM's too: a +100 on one token makes every token it (greedy); without
    it the demo model writes different ones."""
    def tokens(**bias) -> list[str]:
        response = client.completions.create(model="ar", prompt="hello there", max_tokens=6, temperature=0,
                                             logprobs=0, **bias)
        return response.choices[0].logprobs.tokens

    assert len(set(tokens())) > 1
    assert len(set(tokens(logit_bias={"42": 100}))) == 1


def test_a_response_equals_the_chat_completion_of_its_conversation(client):
    """The Responses API: ``instructions`` are the system turn and ``input`` the user's, so a response
    equals the chat completion of the same turns (and another instruction changes it); an earlier
    response's output sent back as the SDK returns it is the assistant's turn."""
    options = {"model": "ar", "max_output_tokens": 8, "extra_body": {"seed": 3}}
    response = client.responses.create(input="hello", instructions="Be brief.", **options)
    chat = client.chat.completions.create(model="ar", max_tokens=8, seed=3, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}])
    assert response.output_text == chat.choices[0].message.content
    other = client.responses.create(input="hello", instructions="Be long.", **options)
    assert other.output_text != response.output_text
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 8 and response.usage.input_tokens == chat.usage.prompt_tokens
    again = client.responses.create(input=[{"role": "user", "content": "hello"}, *response.output,
                                           {"role": "user", "content": [{"type": "input_text", "text": "and?"}]}],
                                    **options)
    chat = client.chat.completions.create(model="ar", max_tokens=8, seed=3, messages=[
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": response.output_text},
        {"role": "user", "content": "and?"}])
    assert again.output_text == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):  # nothing is stored
        client.responses.retrieve(response.id)


def test_a_streamed_response_gives_the_api_s_events_and_the_whole_response(client):
    options = {"model": "ar", "input": "hello", "max_output_tokens": 6, "extra_body": {"seed": 5}}
    whole = client.responses.create(**options)
    kinds = [event.type for event in client.responses.create(stream=True, **options)]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    with client.responses.stream(**options) as stream:  # the SDK's helper checks the events' order
        events = list(stream)
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response  # max_output_tokens ended it: incomplete, as OpenAI's ends such a stream
    assert deltas == final.output_text == whole.output_text and final.usage.output_tokens == 6


def test_chat_streamed_and_whole_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model="ar", messages=messages, max_completion_tokens=8, seed=3)
    chunks = list(client.chat.completions.create(model="ar", messages=messages, max_tokens=8, seed=3, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8


def test_chat_n_choices_logprobs_and_stop(client):
    response = client.chat.completions.create(model="ar", messages=[{"role": "user", "content": "hi"}], n=2,
                                              max_tokens=5, logprobs=True, top_logprobs=2, seed=1,
                                              extra_body={"ignore_eos": True})
    assert [choice.index for choice in response.choices] == [0, 1]
    for choice in response.choices:
        tokens = choice.logprobs.content
        assert len(tokens) == 5 and all(t.logprob <= 0 and len(t.top_logprobs) <= 2 for t in tokens)
    assert response.usage.completion_tokens == 10
    stopped = client.completions.create(model="ar", prompt="hello", max_tokens=30, seed=2, stop=["e"])
    assert "e" not in stopped.choices[0].text


def test_the_async_client_streams_chat_beside_images(gateway):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(model="ar", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=6, seed=1, stream=True)  # (some text, every run)

        async def text():
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        image = client.images.generate(prompt="a fox", size="32x32", extra_body=FAST)
        joined, images = await asyncio.gather(text(), image)
        await client.close()
        return joined, images

    joined, images = asyncio.run(run())
    assert joined and decoded(images.data[0]).shape == (32, 32, 3)


def test_models_are_listed_and_retrieved(client):
    ids = {model.id for model in client.models.list()}
    assert {"ar", "ar_encoder", "diffusion", "omni", "text_to_image"} <= ids
    assert client.models.retrieve("text_to_image").id == "text_to_image"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no_such_model")


# -- errors, as the SDK raises them

def test_errors_are_typed_and_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="ar", messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)
    assert refused.value.body["param"] == "max_tokens"  # refused by the model itself
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(prompt="a fox", size="33x32")
    assert refused.value.body["param"] == "size" and "multiple of 8" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(prompt="a fox", response_format="url")
    assert refused.value.body["param"] == "response_format"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no_such_model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.images.generate(model="no_such_model", prompt="a fox")
    with pytest.raises(openai.BadRequestError) as refused:  # a model that makes no images
        client.images.generate(model="ar", prompt="a fox")
    assert refused.value.body["param"] == "model"


def test_an_api_key_is_required_once_set(server):
    keyed = Gateway(free_port(), "127.0.0.1", server.grpc_url, {}, api_key=KEY).start()
    try:
        base = f"http://{keyed.url}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0).models.list()
        missing = httpx.post(f"{base}/chat/completions", json=CHAT)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        assert openai.OpenAI(base_url=base, api_key=KEY, max_retries=0).models.list().data
        with urllib.request.urlopen(f"http://{keyed.url}/health") as response:  # probes need no key
            assert response.status == 200
    finally:
        keyed.stop()


def test_without_triton_every_answer_is_503(server):
    orphan = Gateway(free_port(), "127.0.0.1", f"localhost:{free_port()}", {}).start()
    try:
        client = openai.OpenAI(base_url=f"http://{orphan.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as unavailable:
            client.images.generate(prompt="a fox")
        assert unavailable.value.status_code == 503
        with pytest.raises(openai.InternalServerError) as unavailable:
            client.models.list()
        assert unavailable.value.status_code == 503
        for call in (lambda: client.responses.create(input="hi"),
                     lambda: client.audio.speech.create(model="speech", input="hi", voice="ethan"),
                     lambda: client.completions.create(model="ar", prompt=["a", "b"])):
            with pytest.raises(openai.InternalServerError) as unavailable:
                call()
            assert unavailable.value.status_code == 503
        assert httpx.get(f"http://{orphan.url}/health").status_code == 503
    finally:
        orphan.stop()


def test_a_client_that_leaves_mid_stream_cancels_its_request(gateway, server):
    """On the transformers engine: vLLM wrote the demo's 1,000 tokens on a loaded CI machine before the
    gateway saw the client leave (CI run 71); the gateway's path to the model is the same."""
    body = {"model": "ar_transformers", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "stream": True}
    httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)  # the chat template loaded (first use)
    time.sleep(1)  # the model's counters reach /metrics a moment after its response

    def count(outcome: str) -> float:
        return metric_value(server, "omni_ar_requests_total", model="ar_transformers", outcome=outcome)

    cancelled, succeeded = count("cancelled"), count("success")
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body | {"max_tokens": 1000, "ignore_eos": True},
                      timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # Closed after one chunk of 1,000 tokens: the model counts it cancelled. Only the cancelled count is
    # this request's own: a success counted meanwhile may be an earlier test's request settling.
    deadline = time.monotonic() + 30
    while count("cancelled") <= cancelled:
        assert time.monotonic() < deadline, (
            "the request was not cancelled in the model ("
            f"{count('success') - succeeded:.0f} requests of ar succeeded meanwhile)")
        time.sleep(0.2)


def test_metrics_count_requests_and_errors_per_endpoint(client, gateway):
    client.models.list()
    with pytest.raises(openai.BadRequestError):
        client.images.generate(prompt="")
    text = httpx.get(f"{gateway}/metrics").text
    def value(pattern):
        return sum(float(v) for v in re.findall(rf"^{pattern} (\S+)$", text, flags=re.M))
    assert value(r'omni_gateway_requests_total\{endpoint="/v1/models",status="200"\}') >= 1
    assert value(r'omni_gateway_errors_total\{endpoint="/v1/images/generations",type="invalid_request_error"\}') >= 1
    assert value(r'omni_gateway_request_duration_seconds_count\{endpoint="/v1/images/generations"\}') >= 1
    documented = documented_metrics(gateway=True)
    assert len(documented) == 4
    for name, kind in documented.items():  # every one in docs/metrics.md is served
        assert re.search(rf"^{name}{'_count' if kind == 'histogram' else ''}\{{", text, flags=re.M), name


def test_several_workers_answer_on_one_port_and_add_up_their_metrics(server):
    gateway = Gateway(free_port(), "127.0.0.1", server.grpc_url, text_model_tokenizers(server.repositories),
                      workers=2).start()
    try:
        base = f"http://{gateway.url}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        for _ in range(6):
            assert client.completions.create(model="ar", prompt="hi", max_tokens=2,
                                             extra_body={"ignore_eos": True}).usage.completion_tokens == 2
        workers = children(gateway.process.pid)
        assert len(workers) >= 2, workers
        # a request is counted once its answer's last byte is sent, which the client may read first:
        # the count is read once no completion is in flight (seen with the sixth, on a busy host)
        deadline = time.monotonic() + 10
        while True:
            text = httpx.get(f"{base}/metrics").text
            busy = re.search(r'^omni_gateway_requests_in_flight\{endpoint="/v1/completions"\} (\S+)$', text, flags=re.M)
            if not (busy and float(busy.group(1))) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        answered = re.search(r'^omni_gateway_requests_total\{endpoint="/v1/completions",status="200"\} (\S+)$', text,
                             flags=re.M)
        assert answered and float(answered.group(1)) == 6, text[:2000]
    finally:
        gateway.stop()
    assert gateway.process.poll() is not None


# -- bad input: each a 4xx in OpenAI's shape naming the field, the gateway healthy after it

CHAT = {"model": "ar", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
IMAGE = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 2}
BAD_INPUTS = [
    # (path, body (bytes are sent as they are), status, the field named)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b'{"messages": "\xff\xfe"}', 400, None),
    ("/v1/chat/completions", {"model": "ar"}, 400, "messages"),
    ("/v1/chat/completions", CHAT | {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", CHAT | {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", CHAT | {"temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", CHAT | {"temperature": 9}, 400, "temperature"),
    ("/v1/chat/completions", CHAT | {"top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", CHAT | {"n": 1000}, 400, "n"),
    ("/v1/chat/completions", CHAT | {"max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", CHAT | {"max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/chat/completions", CHAT | {"stop": ["a"] * 20}, 400, "stop"),
    ("/v1/chat/completions", CHAT | {"stop": 5}, 400, "stop"),
    ("/v1/chat/completions", CHAT | {"top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function"}]}, 400, "tools"),
    # OpenAI's fields that ask for what the gateway does not do, each named with the reason
    ("/v1/chat/completions", CHAT | {"tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/chat/completions", CHAT | {"store": True}, 400, "store"),
    ("/v1/chat/completions", CHAT | {"reasoning_effort": "high"}, 400, "reasoning_effort"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "assistant", "content": None,
                                                   "tool_calls": [{"id": "call_1"}]}]}, 400, "messages.0.tool_calls"),
    ("/v1/chat/completions", CHAT | {"logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", CHAT | {"logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    ("/v1/responses", {"input": ""}, 400, "input"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_object"}}}, 400, "text.format.type"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/chat/completions", CHAT | {"model": "no_such_model"}, 404, "model"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 33}, 400, "prompt"),  # past MAX_PROMPTS
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", 5]}, 400, "prompt.1"),
    ("/v1/completions", {"prompt": [1, 2, 3]}, 400, "prompt"),  # token ids: refused by name
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/images/generations", {}, 400, "prompt"),
    ("/v1/images/generations", IMAGE | {"prompt": ""}, 400, "prompt"),
    ("/v1/images/generations", IMAGE | {"n": 10**9}, 400, "n"),
    ("/v1/images/generations", IMAGE | {"n": 0}, 400, "n"),
    ("/v1/images/generations", IMAGE | {"size": "32"}, 400, "size"),
    ("/v1/images/generations", IMAGE | {"size": "99999x99999"}, 400, "size"),
    ("/v1/images/generations", IMAGE | {"size": "-32x32"}, 400, "size"),
    ("/v1/images/generations", IMAGE | {"size": "30x32"}, 400, "size"),
    ("/v1/images/generations", IMAGE | {"response_format": "url"}, 400, "response_format"),
    ("/v1/images/generations", IMAGE | {"style": "vivid"}, 400, "style"),
    ("/v1/images/generations", IMAGE | {"colour": "red"}, 400, "colour"),
    ("/v1/images/generations", IMAGE | {"num_inference_steps": 0}, 400, "num_inference_steps"),
    ("/v1/images/generations", IMAGE | {"num_inference_steps": 10**6}, 400, "num_inference_steps"),
    ("/v1/images/generations", IMAGE | {"guidance_scale": 1, "true_cfg_scale": 2}, 400, "true_cfg_scale"),
    ("/v1/images/generations", IMAGE | {"seed": "abc"}, 400, "seed"),
    # values past their tensor's type, and integers as strings (OpenAI refuses those too)
    ("/v1/images/generations", IMAGE | {"seed": 2**70}, 400, "seed"),
    ("/v1/images/generations", IMAGE | {"seed": 2**63 - 1, "n": 2}, 400, "seed"),  # image 1's seed is past INT64
    ("/v1/images/generations", IMAGE | {"num_inference_steps": 2**40}, 400, "num_inference_steps"),
    ("/v1/images/generations", IMAGE | {"num_inference_steps": "5"}, 400, "num_inference_steps"),
    ("/v1/images/generations", IMAGE | {"n": "2"}, 400, "n"),
    ("/v1/images/generations", IMAGE | {"guidance_scale": "4"}, 400, "guidance_scale"),
    ("/v1/chat/completions", CHAT | {"max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/chat/completions", CHAT | {"seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**40}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/images/generations", IMAGE | {"step_cache": "teacache"}, 400, "step_cache"),
    ("/v1/images/generations", IMAGE | {"step_cache": "first_block"}, 400, "step_cache"),  # the SD demo: no cache
    ("/v1/images/generations", IMAGE | {"model": "no_such_model"}, 404, "model"),
    ("/v1/images/generations", b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}', 413, None),
    ("/v1/no_such_endpoint", CHAT, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS,
                         ids=[f"{i}-{path.rsplit('/', 1)[-1]}-{param}" for i, (path, _, _, param) in
                              enumerate(BAD_INPUTS)])
def test_bad_input(gateway, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{gateway}{path}", content=content, headers={"Content-Type": "application/json"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    assert httpx.get(f"{gateway}/health").status_code == 200


def test_a_refused_value_leaves_the_connection_usable(gateway):
    """A seed past INT64 was a 500 whose connection the server then dropped: the client's next
    request on it was reset. It is a 400 now, and the same keep-alive connection answers again."""
    connection = http.client.HTTPConnection(gateway.removeprefix("http://"), timeout=60)
    headers = {"Content-Type": "application/json"}
    for body, status in ((IMAGE | {"seed": 2**70}, 400), (IMAGE | {"seed": 1}, 200)):
        connection.request("POST", "/v1/images/generations", json.dumps(body), headers)
        response = connection.getresponse()
        assert response.status == status and response.getheader("connection") != "close"
        response.read()
    connection.close()


def test_the_benchmark_measures_the_gateway_against_direct_grpc(gateway, server, tmp_path):
    """``benchmarks/openai_gateway.py`` against this server and gateway, its chat side on aiohttp: both
    workloads measured on both sides and the report's shape, never a ratio (docs/benchmarks.md quotes the
    GPU figures)."""
    out_file = tmp_path / "gateway.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "openai_gateway.py"), "--grpc-url", server.grpc_url,
               "--openai-url", gateway, "--tokenizer", text_model_tokenizers(server.repositories)["ar"],
               "--rounds", "1", "--image-concurrency", "2", "--image-requests", "2", "--chat-concurrency", "4",
               "--chat-requests", "4", "--http-client", "aiohttp", "--json", str(out_file)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "time to first token" in result.stdout
    images, chat = json.loads(out_file.read_text())["results"]
    assert images["gateway"] > 0 and images["direct"] > 0
    assert chat["gateway"] > 0 and chat["direct"] > 0  # tokens counted on both sides
    assert set(chat["first_token_p50_s"]) == {"gateway", "direct"}
