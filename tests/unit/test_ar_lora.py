"""LoRA adapters per request on the AR stages (``lora_adapters`` of ``ar`` and ``ar_encoder``), on
the transformers engine and the CPU: concurrent requests with different adapters, and none, are
decoded in one forward pass per step, and each text is the one the model with its adapter merged
by PEFT gives (greedy); an adapter on the encoder gives ``PeftModel``'s hidden states. vLLM serves
them with ``LoRARequest`` on a GPU (tests/gpu/test_ar_lora.py); on the CPU its kernels mix the rows
of a step (measured), so ``engine: auto`` takes the transformers engine there and ``vllm`` is
refused at load, saying why. Requests name an adapter by ``lora``, or ``lora_name`` among the
sampling options as Triton's vLLM backend's clients do; an unknown one is refused by name."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM
from triton_omni.ar.request import EncodeRequest, GenerateRequest
from triton_omni.ar.runner import ArRunner, ArRunnerConfig
from triton_omni.ar.sampling import ArLimits
from triton_omni.demo_models import AR_DEMO, resolve_model
from triton_omni.errors import RequestValidationError

from tests.support.loras import build_llm_lora, merged_llm

PROMPT = "Once upon a time"
_ids = itertools.count()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("llm-loras")
    return {"x": str(build_llm_lora(root / "x", seed=1)),
            "y": str(build_llm_lora(root / "y", seed=2, rank=4, alpha=16, targets=("q_proj", "v_proj")))}


def generate(runner: ArRunner, requests: list[dict]) -> list[str]:
    """Each request's text, all submitted at once (they share the engine's steps)."""
    async def one(values: dict) -> str:
        request = GenerateRequest.from_inputs({"text_input": PROMPT, "max_tokens": 12, "temperature": 0.0} | values,
                                              ArLimits())
        runner.check(request)
        responses = []
        await runner.stream(request, f"r{next(_ids)}", responses.append)
        return responses[-1].texts[0]

    async def all_of() -> list[str]:
        return list(await asyncio.gather(*(one(values) for values in requests)))

    return runner.loop.run(all_of())


def test_concurrent_requests_with_different_adapters_get_the_merged_models_texts(adapters, tmp_path):
    runner = ArRunner(ArRunnerConfig(f"demo:{AR_DEMO}", engine="transformers", lora_adapters=adapters, max_loras=2))
    try:
        asks = [{"lora": "x"}, {}, {"lora": "y"}, {"sampling_parameters": '{"lora_name": "x"}'}]
        served = generate(runner, asks)
        assert runner.engine.batcher.max_rows_seen >= 3
    finally:
        runner.close()
    references = {}
    for name in ("x", "y", None):
        model = merged_llm(adapters[name], tmp_path / name) if name else f"demo:{AR_DEMO}"
        plain = ArRunner(ArRunnerConfig(str(model), engine="transformers"))
        try:
            references[name] = generate(plain, [{}])[0]
        finally:
            plain.close()
    assert served == [references["x"], references[None], references["y"], references["x"]]
    assert len({references["x"], references["y"], references[None]}) == 3  # each adapter shows


def test_an_encoders_adapter_gives_peft_models_hidden_states(adapters):
    from peft import PeftModel

    runner = ArRunner(ArRunnerConfig(f"demo:{AR_DEMO}", mode="encode", engine="transformers",
                                     lora_adapters=adapters))
    try:
        encoded = runner.loop.run(runner.encode([EncodeRequest(PROMPT, lora="x"), EncodeRequest(PROMPT),
                                                 EncodeRequest(PROMPT, "blurry", with_negative=True, lora="y")]))
    finally:
        runner.close()
    path = resolve_model(f"demo:{AR_DEMO}")
    ids = runner.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        def states(adapter: str | None) -> torch.Tensor:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            model = PeftModel.from_pretrained(model, adapters[adapter]) if adapter else model
            return model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]

        expected = {name: states(name) for name in ("x", "y", None)}
    for got, name in ((encoded[0].hidden_states, "x"), (encoded[1].hidden_states, None),
                      (encoded[2].hidden_states, "y")):
        assert (got - expected[name]).abs().max() < 1e-4, name
    assert (expected["x"] - expected[None]).abs().max() > 0.5  # the adapter moves the conditioning
    assert encoded[2].negative_hidden_states.shape[0] > 0


def test_bad_adapters_and_requests_are_refused_by_name(adapters, tmp_path):
    runner = ArRunner(ArRunnerConfig(f"demo:{AR_DEMO}", engine="transformers", lora_adapters=adapters))
    try:
        for values, field, says in (({"lora": "nope"}, "lora", "unknown adapter"),
                                    ({"sampling_parameters": '{"lora_name": "nope"}'}, "lora_name", "unknown adapter"),
                                    ({"lora": "x", "sampling_parameters": '{"lora_name": "y"}'}, "lora", "differ")):
            with pytest.raises(RequestValidationError) as refused:
                runner.check(GenerateRequest.from_inputs({"text_input": PROMPT} | values, ArLimits()))
            assert refused.value.parameter == field and says in str(refused.value)
        [error] = runner.loop.run(runner.encode([EncodeRequest(PROMPT, lora="nope")]))
        assert isinstance(error, RequestValidationError) and error.parameter == "lora"
    finally:
        runner.close()
    from triton_omni.lora import AdapterError

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="'broken'"):
        ArRunner(ArRunnerConfig(f"demo:{AR_DEMO}", engine="transformers", lora_adapters={"broken": str(tmp_path /
                                                                                                        "broken")}))


def test_vllm_on_the_cpu_leaves_adapters_to_the_transformers_engine(adapters):
    config = ArRunnerConfig(f"demo:{AR_DEMO}", engine="auto", lora_adapters=adapters)
    assert config.resolved_engine() == "transformers"
    with pytest.raises(ValueError, match="prefill and decode share a step"):
        ArRunnerConfig(f"demo:{AR_DEMO}", engine="vllm", lora_adapters=adapters).resolved_engine()
    assert ArRunnerConfig(f"demo:{AR_DEMO}", engine="auto").resolved_engine() == "vllm"
