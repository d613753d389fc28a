"""LoRA adapters on vLLM on a GPU (``LoRARequest``): requests with two adapters and without one,
arriving while the others decode (prefills and decodes sharing steps, the company vLLM 0.32's CPU
kernels got wrong), each start the text they give alone, and an adapter's text starts as the
model with that adapter merged by PEFT starts it; ``ar_encoder``'s states with an adapter are
``PeftModel``'s (cosine). bf16 (vLLM's LoRA kernels take no float32), greedy: a batch's kernels
may move a random tiny model's later tokens, so the texts are compared by their start, which a
row given another's adapter gets wrong from its first token. GPU only (docs/gpu.md)."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools

import pytest
import torch

if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
    pytest.skip("needs a CUDA device and vLLM", allow_module_level=True)

from triton_omni.ar import ArRunner, ArRunnerConfig, EncodeRequest, GenerateRequest
from triton_omni.ar.sampling import ArLimits
from triton_omni.demo_models import AR_DEMO, build_all, resolve_model

from tests.support.loras import build_llm_lora, merged_llm

MODEL = f"demo:{AR_DEMO}"
PROMPT = "Once upon a time"
_ids = itertools.count()
START = 8  # characters of a text compared


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    build_all()
    root = tmp_path_factory.mktemp("llm-loras")
    return {"x": str(build_llm_lora(root / "x", seed=1)),
            "y": str(build_llm_lora(root / "y", seed=2, rank=4, alpha=16, targets=("q_proj", "v_proj")))}


def runner(model: str, mode: str = "generate", adapters: dict | None = None, engine: str = "vllm") -> ArRunner:
    return ArRunner(ArRunnerConfig(model, mode, engine=engine, device="cuda", dtype="bfloat16",
                                   gpu_memory_utilization=0.1, lora_adapters=adapters or {}))


def texts(model: ArRunner, asks: list[str | None], stagger_s: float = 0.0) -> list[str]:
    """Each request's greedy text; the ``i``-th starts ``i * stagger_s`` after the first."""
    async def one(index: int, lora: str | None) -> str:
        await asyncio.sleep(index * stagger_s)
        request = GenerateRequest.from_inputs({"text_input": PROMPT, "max_tokens": 24, "temperature": 0.0,
                                               "exclude_input_in_output": True} | ({"lora": lora} if lora else {}),
                                              ArLimits())
        model.check(request)
        responses = []
        await model.stream(request, f"r{next(_ids)}", responses.append)
        return responses[-1].texts[0]

    async def all_of() -> list[str]:
        return list(await asyncio.gather(*(one(i, lora) for i, lora in enumerate(asks))))

    return model.loop.run(all_of())


def test_adapters_in_company_on_vllm_give_their_texts_alone_and_the_merged_models(adapters, tmp_path):
    asks = ["x", None, "y", "x", None, "y"]
    served = runner(MODEL, adapters=adapters)
    try:
        alone = {lora: texts(served, [lora])[0] for lora in ("x", "y", None)}
        company = texts(served, asks, stagger_s=0.02)
    finally:
        served.close()
    assert [text[:START] for text in company] == [alone[lora][:START] for lora in asks]
    assert len({text[:START] for text in alone.values()}) == 3
    for name in ("x", "y"):
        merged = runner(str(merged_llm(adapters[name], tmp_path / name)), engine="transformers")
        try:
            assert texts(merged, [None])[0][:START] == alone[name][:START]
        finally:
            merged.close()


def test_an_encoders_adapter_on_vllm_gives_peft_models_states(adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    encoder = runner(MODEL, "encode", adapters)
    try:
        encoded = encoder.loop.run(encoder.encode([EncodeRequest(PROMPT, lora="x"), EncodeRequest(PROMPT)]))
        ids = encoder.tokenizer(PROMPT, return_tensors="pt").input_ids.cuda()
    finally:
        encoder.close()
    path = resolve_model(MODEL)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
        plain = base(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        adapted = PeftModel.from_pretrained(base, adapters["x"])(input_ids=ids, output_hidden_states=True)
    for got, expected in ((encoded[0].hidden_states, adapted.hidden_states[-1][0]), (encoded[1].hidden_states, plain)):
        assert torch.nn.functional.cosine_similarity(got.cuda().float(), expected.float(), dim=-1).min() > 0.99
