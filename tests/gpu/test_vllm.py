"""The AR stage on vLLM on a GPU: streaming (a prompt joining a running
stream included), cancellation reaching vLLM's ``abort``, ``ar_encoder``'s
embeddings equal to the transformers engine's for the same weights,
Qwen-Image's recipe on vLLM equal to its pipeline's ``encode_prompt`` (bf16),
and two runners in front of one engine core. GPU only (docs/gpu.md)."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest
import torch

if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
    pytest.skip("needs a CUDA device and vLLM", allow_module_level=True)

from triton_omni.ar import ArRunner, ArRunnerConfig, EncodeRequest, GenerateRequest
from triton_omni.demo_models import build_all

MODEL = "demo:tiny-qwen2"


@pytest.fixture(scope="module")
def generator():
    build_all()
    runner = ArRunner(ArRunnerConfig(MODEL, "generate", engine="vllm", device="cuda", gpu_memory_utilization=0.1))
    yield runner
    runner.close()


def request(max_tokens: int, stream: bool = True) -> GenerateRequest:
    return GenerateRequest.from_inputs({"text_input": "a lighthouse", "stream": stream, "sampling_parameters":
                                        json.dumps({"max_tokens": max_tokens, "ignore_eos": True})},
                                       ArRunnerConfig(MODEL).limits)


def test_streams_every_token(generator):
    async def run():
        return [r async for r in generator.generate(request(64), "stream-1")]

    responses = generator.loop.run(run())
    assert len(responses) > 1
    assert sum(sum(r.num_output_tokens) for r in responses) == 64
    assert responses[-1].final and responses[-1].finish_reasons == ["length"]


def test_a_prompt_joining_a_running_stream_gets_every_token(generator):
    """One step then holds the newcomer's prompt beside the running stream's
    decode (a mixed batch, which vLLM runs with its attention outside the CUDA graphs)."""
    async def collect(request_id: str, max_tokens: int, delay_s: float):
        await asyncio.sleep(delay_s)
        return [r async for r in generator.generate(request(max_tokens), request_id)]

    async def run():
        return await asyncio.gather(collect("running", 256, 0), collect("joining", 64, 0.05))

    for responses, expected in zip(generator.loop.run(run()), (256, 64), strict=True):
        assert sum(sum(r.num_output_tokens) for r in responses) == expected
        assert responses[-1].final and responses[-1].finish_reasons == ["length"]


def test_cancellation_reaches_vllm_abort(generator):
    llm = generator.engine.engine  # the AsyncLLM
    aborted = []
    real_abort = llm.abort

    async def spy(request_id, *args, **kwargs):
        aborted.append(request_id)
        return await real_abort(request_id, *args, **kwargs)

    llm.abort = spy
    try:
        async def run():
            async def consume():
                async for _ in generator.generate(request(100_000 // 100), "victim"):
                    pass

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.2)  # under way
            task.cancel()  # what the Triton adapter does on a client's cancellation
            await generator.abort("victim")
            await asyncio.sleep(0.5)
            return llm.output_processor.has_unfinished_requests()

        unfinished = generator.loop.run(run())
    finally:
        llm.abort = real_abort
    assert "victim" in aborted
    assert not unfinished


def test_encoder_embeddings_match_the_transformers_engine():
    build_all()
    prompts = ["a lighthouse on a cliff at dusk", "x", "the quick brown fox jumps over the lazy dog"]
    embeddings = {}
    for engine in ("vllm", "transformers"):
        runner = ArRunner(ArRunnerConfig(MODEL, "encode", engine=engine, device="cuda", dtype="bfloat16",
                                         gpu_memory_utilization=0.1))
        try:
            results = runner.loop.run(runner.encode([EncodeRequest(p) for p in prompts]))
            embeddings[engine] = [r.hidden_states.float().cpu() for r in results]
        finally:
            runner.close()
    for ours, reference in zip(embeddings["vllm"], embeddings["transformers"], strict=True):
        assert ours.shape == reference.shape
        cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
        assert cosine.min() > 0.99, cosine
        assert (ours - reference).abs().max() <= 0.05 * reference.abs().max()


def test_qwen_image_recipe_on_vllm_equals_the_pipelines_encoding():
    """In bf16 on the GPU: per token a cosine of at least 0.999 with
    ``QwenImagePipeline.encode_prompt`` on the same weights, as many tokens."""
    from diffusers import QwenImagePipeline
    from triton_omni.demo_models import resolve_model

    prompts = ["a lighthouse on a cliff at dusk", "x", "the quick brown fox jumps over the lazy dog"]
    runner = ArRunner(ArRunnerConfig("demo:tiny-qwen-image", "encode", engine="vllm", recipe="qwen_image",
                                     device="cuda", dtype="bfloat16", gpu_memory_utilization=0.1))
    try:
        results = runner.loop.run(runner.encode([EncodeRequest(p) for p in prompts]))
    finally:
        runner.close()
    pipeline = QwenImagePipeline.from_pretrained(resolve_model("demo:tiny-qwen-image"), torch_dtype=torch.bfloat16)
    pipeline.text_encoder.to("cuda")
    for prompt, result in zip(prompts, results, strict=True):
        with torch.inference_mode():
            expected, _ = pipeline.encode_prompt(prompt=prompt, device="cuda")
        ours, reference = result.hidden_states.float().cpu(), expected[0].float().cpu()
        assert ours.shape == reference.shape, prompt
        cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
        print(f"{prompt!r}: cosine min {cosine.min():.5f}")
        assert cosine.min() >= 0.999, (prompt, cosine.min())


def test_two_runners_share_one_engine_core(generator, tmp_path):
    """What ``instances_per_engine: 2`` does in two stubs, here in one process:
    the first runner starts the engine core, the second connects to it; both
    stream, each its own request, greedy text equal to an engine of its own."""
    from triton_omni.ar.shared_engine import take_seat

    config = ArRunnerConfig(MODEL, "generate", engine="vllm", device="cuda", gpu_memory_utilization=0.1)
    first = ArRunner(config, take_seat(tmp_path, 2))
    second = ArRunner(config, take_seat(tmp_path, 2))
    try:
        assert (first.seat.starts_engine, second.seat.starts_engine) == (True, False)

        greedy = GenerateRequest.from_inputs({"text_input": "a lighthouse", "stream": True, "sampling_parameters":
                                              json.dumps({"max_tokens": 48, "temperature": 0, "ignore_eos": True})},
                                             config.limits)

        def text(runner, request_id):
            async def run():
                return "".join([r.texts[0] async for r in runner.generate(greedy, request_id)])
            return runner.loop.submit(run())

        futures = [text(first, "a"), text(second, "b"), text(first, "c"), text(second, "d")]
        texts = [future.result(timeout=120) for future in futures]
        alone = text(generator, "alone").result(timeout=120)
        assert texts == [alone] * 4
    finally:
        second.close()
        first.close()
