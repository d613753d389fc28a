"""The scheduler's view of one prompt joining a running request, step by
step, on vLLM's engine core in a process of its own (tests of
``ar/prompt_cadence.py`` on CPU and GPU). ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
puts the engine core in the caller, and vLLM then caches its environment for
the life of that process: hence the subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from triton_omni.demo_models import build_all

# Request "a" alone from step 1; request "b" added before step ``JOIN``. Prints, after every step,
# [the scheduler's step, requests running, requests waiting].
TRACE = """
import json, sys
from triton_omni.demo_models import resolve_model
from triton_omni.ar.prompt_cadence import with_prompt_cadence
from vllm import EngineArgs, SamplingParams
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.llm_engine import LLMEngine

interval, join, extra = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
args = EngineArgs(model=resolve_model("demo:tiny-qwen2"), max_model_len=256, prefill_schedule_interval=interval,
                  **extra)
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


def trace(interval: int, join: int, **engine_args) -> tuple[str, list[list[int]]]:
    """The scheduler's class name, and [step, requests running, requests waiting] after each step."""
    build_all()
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", TRACE, str(interval), str(join), json.dumps(engine_args)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TRACE ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    name, steps = json.loads(lines[-1].removeprefix("TRACE "))
    return name, steps


def first_step_running_both(steps: list[list[int]]) -> int:
    return next(step for step, running, _ in steps if running == 2)
