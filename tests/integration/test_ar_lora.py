"""LoRA adapters on a served text model: `ar_transformers` names two PEFT adapters in its folder
(`lora_adapters` with relative paths). A request chooses one by the `lora` input (gRPC), or by
`lora_name` as Triton's vLLM backend's clients send it (HTTP `/generate`'s body), and gets the same
text either way, another than the base model's; concurrent requests with each adapter and none
share the engine's steps and keep their texts. The OpenAI gateway lists each adapter as a model
(`parent`: its model) and serves chat and completions with `model` an adapter's name, as vLLM's
server does. An unknown adapter is an INVALID_ARG naming `lora`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from triton_omni_client import OmniClient, OmniError

from tests.support.server import metric_value

MODEL = "ar_transformers"
PROMPT = "Once upon a time"
GREEDY = {"max_tokens": 8, "temperature": 0.0}


def text(url: str, protocol: str = "grpc", sampling: dict | None = None, **options) -> str:
    client = OmniClient(url, protocol=protocol)
    chunks = client.generate_text(PROMPT, model=MODEL, exclude_input_in_output=True,
                                  sampling_parameters=GREEDY | (sampling or {}), **options)
    return "".join(chunk.text for chunk in chunks)


def test_a_request_chooses_its_adapter_by_lora_or_lora_name(server, grpc_url, http_url):
    with ThreadPoolExecutor(4) as pool:
        pirate, base, poet, again = pool.map(lambda lora: text(grpc_url, **({"lora": lora} if lora else {})),
                                             ["pirate", None, "poet", "pirate"])
    assert len({pirate, base, poet}) == 3 and again == pirate
    assert text(http_url, "http", sampling={"lora_name": "pirate"}) == pirate
    assert metric_value(server, "omni_ar_lora_requests_total", model=MODEL, adapter="pirate") >= 3
    assert metric_value(server, "omni_ar_lora_loads_total", model=MODEL, adapter="poet") >= 1
    with pytest.raises(OmniError) as refused:
        text(grpc_url, lora="parrot")
    assert refused.value.status == "INVALID_ARG" and "lora" in str(refused.value) and "parrot" in str(refused.value)


def test_the_gateway_serves_each_adapter_as_a_model(grpc_url, gateway):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused")
    listed = {model.id: model for model in client.models.list().data}
    assert listed["pirate"].model_extra["parent"] == MODEL and listed["poet"].model_extra["parent"] == MODEL
    assert client.models.retrieve("poet").model_extra["parent"] == MODEL
    completion = client.completions.create(model="pirate", prompt=PROMPT, **GREEDY)
    assert completion.model == "pirate" and completion.choices[0].text == text(grpc_url, lora="pirate")
    chat = client.chat.completions.create(model="poet", messages=[{"role": "user", "content": "hi"}], **GREEDY)
    assert chat.model == "poet" and chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="parrot", prompt=PROMPT, **GREEDY)
