"""benchmarks/engine_steps.py, the count of a vLLM engine's steps by kind: the
wrapper counts what vLLM's model runner chose and skips graph captures, and
the report sums windows per side and concurrency."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import types
from enum import Enum
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_steps.py"
spec = importlib.util.spec_from_file_location("engine_steps", SCRIPT)
engine_steps = sys.modules["engine_steps"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engine_steps)


class Mode(Enum):
    FULL = 2
    PIECEWISE = 1


def fake_runner_module(modes: list[Mode]):
    """A stand-in for vllm.v1.worker.gpu_model_runner whose runner returns ``modes`` in turn."""
    chosen = iter(modes)

    class GPUModelRunner:
        def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, num_scheduled_tokens_np,
                                                   max_num_scheduled_tokens, use_cascade_attn, **kwargs):
            return next(chosen), object(), False, None, None

    return types.SimpleNamespace(GPUModelRunner=GPUModelRunner)


def test_the_wrapper_counts_decode_and_prompt_steps_and_skips_captures(monkeypatch):
    module = fake_runner_module([Mode.FULL, Mode.FULL, Mode.PIECEWISE, Mode.FULL])
    counter = engine_steps.StepCounter()
    engine_steps.patch_runner(module, counter)
    clock = iter([0.0, 0.002, 0.010, 0.012])
    monkeypatch.setattr(engine_steps.time, "perf_counter", lambda: next(clock))
    runner = module.GPUModelRunner()
    runner._determine_batch_execution_and_padding(8, 8, None, 1, False)  # decode at 0 ms
    runner._determine_batch_execution_and_padding(8, 8, None, 1, False, force_uniform_decode=True)  # a capture
    runner._determine_batch_execution_and_padding(30, 9, None, 22, False)  # a prompt joins at 2 ms
    runner._determine_batch_execution_and_padding(9, 9, None, 1, False)  # decode at 10 ms
    stats = counter.snapshot()
    assert stats["decode/FULL"][:2] == [1, pytest.approx(0.002)] and stats["decode/FULL"][2] == 17
    assert stats["prompt/PIECEWISE"] == [1, pytest.approx(0.008), 30]


def test_an_idle_engine_never_counts_as_a_long_step():
    counter = engine_steps.StepCounter()
    counter.step("decode/FULL", 1, 0.0)
    counter.step("decode/FULL", 1, 30.0)  # the next request came half a minute later
    assert counter.snapshot()["decode/FULL"][1] == engine_steps.IDLE_S


def snapshots(parent: str, windows: list[dict[str, list[float]]]) -> list[dict]:
    lines, total = [{"t": 0, "pid": 1, "parent": parent, "stats": {}}], {}
    for i, window in enumerate(windows, 1):
        for kind, entry in window.items():
            total[kind] = [a + b for a, b in zip(total.get(kind, [0, 0.0, 0]), entry, strict=True)]
        lines.append({"t": 2 * i, "pid": 1, "parent": parent, "stats": {k: list(v) for k, v in total.items()}})
    return lines


def test_the_report_files_windows_by_side_and_concurrency(tmp_path):
    # direct at 8 streams: 1,000 decode steps of 2 ms; Triton: 900 of 2.2 ms and 100 prompt steps of 6 ms
    direct = snapshots("python -m triton_omni_tools.cli bench", [{"decode/FULL": [1000, 2.0, 8000]}])
    triton = snapshots("/x/triton_python_backend_stub /tmp/m", [
        {"decode/FULL": [900, 1.98, 7200], "prompt/PIECEWISE": [100, 0.6, 2000]},
        {"decode/FULL": [10, 0.02, 80]},  # too few steps to count
    ])
    for name, lines in (("1.jsonl", direct), ("2.jsonl", triton)):
        (tmp_path / name).write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    summary = engine_steps.summarize(engine_steps.read_logs(tmp_path), [1, 8, 32, 64])
    assert set(summary) == {(8, "direct"), (8, "triton")}
    assert summary[8, "triton"]["decode_ms"] == pytest.approx(2.2)
    assert summary[8, "triton"]["prompt_share"] == pytest.approx(0.1)
    assert summary[8, "triton"]["prompt_ms"] == pytest.approx(6.0)
    assert engine_steps.engine_ratio(summary, 8) == pytest.approx(2.0 / 2.58)
    assert "0.78" in engine_steps.report(tmp_path, [1, 8, 32, 64])


def test_a_phase_is_timed_around_each_call_even_when_it_raises(monkeypatch):
    class Scheduler:
        def schedule(self, fail=False):
            if fail:
                raise ValueError("no")
            return "scheduled"

    counter = engine_steps.StepCounter()
    engine_steps.patch_phase(types.SimpleNamespace(Scheduler=Scheduler), "Scheduler", "schedule", "schedule", counter)
    clock = iter([0.0, 0.001, 0.010, 0.013])
    monkeypatch.setattr(engine_steps.time, "perf_counter", lambda: next(clock))
    assert Scheduler().schedule() == "scheduled"
    with pytest.raises(ValueError):
        Scheduler().schedule(fail=True)
    assert counter.phase_snapshot()["schedule"] == [2, pytest.approx(0.004)]


def test_thread_times_are_read_per_thread_id_and_ancestors_name_the_side():
    threads = engine_steps.thread_times()
    assert len(threads[str(threading.get_native_id())]) == 4  # CPU ns, waiting ns, slices, name
    child = subprocess.run([sys.executable, "-c", "import runpy, sys; "
                            f"print(runpy.run_path({str(SCRIPT)!r})['_ancestors']())"],
                           capture_output=True, text=True, check=True).stdout
    own = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200].strip()
    assert child.startswith(own + " < ")  # the parent first, then its ancestors


def test_the_report_splits_a_step_into_its_parts(tmp_path):
    lines = snapshots("/x/triton_python_backend_stub /tmp/m", [{"decode/FULL": [1000, 2.5, 8000]}])
    lines[0] |= {"phases": {}, "threads": {"7": [0, 0, 0], "8": [0, 0, 0]}, "main_thread": "None"}
    lines[1] |= {"phases": {"schedule": [1000, 0.3], "wait": [1000, 1.0]}, "main_thread": "7",
                 "threads": {"7": [2_000_000_000, 100_000_000, 5000], "8": [400_000_000, 0, 10],
                             "9": [100_000_000, 0, 3]}}  # a thread that started in the window
    (tmp_path / "1.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    s = engine_steps.summarize(engine_steps.read_logs(tmp_path), [8])[8, "triton"]
    assert s["phases_ms"] == {"schedule": pytest.approx(0.3), "wait": pytest.approx(1.0)}
    assert (s["main_cpu_ms"], s["main_wait_ms"], s["others_cpu_ms"]) == pytest.approx((2.0, 0.1, 0.5))
    assert "where a step's time goes" in engine_steps.report(tmp_path, [8])
