"""The bench report's arithmetic: pairs of a point, and when both sides fit on the GPU."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from triton_omni_tools.bench.harness import Point, Stream, crowded_gpu
from triton_omni_tools.bench.report import table
from triton_omni_tools.memory_plan import Share


def _point(side: str, turn: int, seconds: float, workload: str = "ar_encoder") -> Point:
    point = Point(workload, 8, side, 100, seconds, [0.01] * 100)
    point.turn = turn
    return point


def test_a_point_in_pairs_reports_the_median_ratio_of_its_pairs():
    # direct drifts from 100/s to 50/s over the run; triton stays 0.9 of it within each pair
    points = [_point("direct", 0, 1.0), _point("triton", 0, 1 / 0.9), _point("batch", 0, 0.5),
              _point("triton", 1, 1 / 0.45), _point("direct", 1, 2.0),
              _point("direct", 2, 1.25), _point("triton", 2, 1.25 / 0.95)]
    [row] = table(points)
    assert [round(r, 3) for r in row["ratios"]] == [0.9, 0.9, 0.95]
    assert round(row["ratio"], 3) == 0.9  # the ratio of the two sides' medians would read 76/80 = 0.95
    assert round(row["direct_per_s"], 1) == 80.0 and round(row["triton_per_s"], 1) == 76.0
    assert round(row["batch_per_s"]) == 200 and row["concurrency"] == 8


def test_a_point_cut_short_of_its_triton_side_has_no_row():
    assert table([_point("direct", 0, 1.0), _point("triton", 0, 1.0), _point("direct", 1, 1.0)])[0]["ratios"] == [1.0]
    assert table([_point("direct", 0, 1.0)]) == []


def test_generation_rows_take_the_median_of_each_figure():
    def stream_point(side: str, turn: int, ttft_s: float) -> Point:
        streams = [Stream(ttft_s, [0.002] * 15, 16, ttft_s + 0.03)] * 4
        point = Point("ar", 4, side, 4, 1.0, [s.latency_s for s in streams], streams=streams)
        point.turn = turn
        return point

    [row] = table([stream_point("direct", t, 0.010) for t in range(3)]
                  + [stream_point("triton", t, ttft) for t, ttft in enumerate((0.012, 0.030, 0.014))])
    assert row["unit"] == "tokens" and row["ratios"] == [1.0, 1.0, 1.0]
    assert round(row["triton_ttft_p50_ms"], 1) == 14.0 and round(row["direct_ttft_p50_ms"], 1) == 10.0


def test_both_sides_stay_loaded_only_where_their_gpu_shares_fit():
    server = [Share("ar", 0, 1, 0.3), Share("ar_encoder", 0, 1, 0.1), Share("ar", 1, 1, 0.5)]
    assert crowded_gpu(0.4, server) is None  # 0.8 on GPU 0; GPU 1 is not the direct side's
    assert crowded_gpu(0.0, []) is None  # CPU
    why = crowded_gpu(0.85, server)
    assert why is not None and "0.85" in why and "0.40" in why


def test_the_cpu_window_counts_the_engine_cores_it_is_given_and_the_host():
    """The window's engine figure is the spinning process's own CPU time over the window, read here
    from /proc around it: whatever share of a core a loaded host gives that process (on CI's two
    busy cores it got 0.49 of one, which failed a fixed lower bound)."""
    import os
    import subprocess

    from triton_omni.processes import command_line
    from triton_omni_tools.bench.cpu import CpuWindow, engine_cores, process_cpu_s

    spinning = subprocess.Popen(["VLLM::EngineCore", "-c", "while True: pass"], executable=sys.executable)
    try:
        # Popen returns when the child's close-on-exec pipe closes, which the kernel does before it
        # sets the new program's arguments: on a busy host /proc/<pid>/cmdline is empty a moment longer
        deadline = time.monotonic() + 10
        while not command_line(spinning.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine_cores(os.getpid(), children_only=True) == [spinning.pid]
        outer_start, before_start = process_cpu_s(spinning.pid), time.monotonic()
        window = CpuWindow([spinning.pid], server=os.getpid()).start()
        after_start, inner_start = time.monotonic(), process_cpu_s(spinning.pid)
        time.sleep(1.0)
        inner_spun_s, before_stop = process_cpu_s(spinning.pid) - inner_start, time.monotonic()
        cores = window.stop()
        after_stop, outer_spun_s = time.monotonic(), process_cpu_s(spinning.pid) - outer_start
        assert inner_spun_s > 0.02  # it ran
        # that process's time, no other's: the window's CPU seconds (its cores times its length, which
        # lies between these reads) between what it spun inside the window and around it; /proc counts
        # in 10 ms ticks, and this process may stall anywhere between the reads
        tick = 0.01
        assert cores["engine"] * (after_stop - before_start) >= inner_spun_s - 2 * tick
        assert cores["engine"] * (before_stop - after_start) <= outer_spun_s + 2 * tick
        assert cores["engine"] <= 1.05 and cores["host"] >= cores["engine"] - 0.05
        assert cores["tritonserver"] < 0.5  # this process slept
    finally:
        spinning.kill()


def _bench_config(preset, dest, model: str):
    """``model``'s config in the repositories the bench serves for ``preset``."""
    from triton_omni_tools.bench import bench_repository
    from triton_omni_tools.repository import load_config

    [config] = [load_config(repo / model / "config.pbtxt") for repo in bench_repository(preset, dest)
                if (repo / model / "config.pbtxt").exists()]
    return config


def test_the_ar_engine_args_reach_the_servers_ar_as_they_reach_the_direct_side(tmp_path):
    import json
    from dataclasses import replace

    from triton_omni_tools.bench import PRESETS

    config = _bench_config(replace(PRESETS["tiny"], ar_engine_args='{"stream_interval": 4}'), tmp_path, "ar")
    assert json.loads(config.parameters["engine_args"].string_value) == {"stream_interval": 4}


def test_the_encoder_engine_args_reach_the_servers_ar_encoder_only(tmp_path):
    import json
    from dataclasses import replace

    from triton_omni_tools.bench import PRESETS

    preset = replace(PRESETS["tiny"], encoder_engine_args='{"max_num_seqs": 8}')
    encoder = _bench_config(preset, tmp_path / "a", "ar_encoder")
    assert json.loads(encoder.parameters["engine_args"].string_value) == {"max_num_seqs": 8}
    assert "engine_args" not in _bench_config(preset, tmp_path / "b", "ar").parameters
    assert preset.engine_args("ar_encoder") == {"max_num_seqs": 8} and preset.engine_args("ar") == {}


def test_engine_cpus_reach_both_vllm_stages_and_the_bench_keeps_off_them(tmp_path):
    import os
    import subprocess
    import sys
    from dataclasses import replace

    from triton_omni_tools.bench import PRESETS

    preset = replace(PRESETS["tiny"], engine_cpus="0")
    for stage in ("ar", "ar_encoder"):
        assert _bench_config(preset, tmp_path / stage, stage).parameters["engine_cpus"].string_value == "0"
    assert "engine_cpus" not in _bench_config(PRESETS["tiny"], tmp_path / "none", "ar").parameters
    if len(os.sched_getaffinity(0)) > 1:  # in a process of its own: this one's CPUs stay
        last = max(os.sched_getaffinity(0))
        moved = subprocess.run([sys.executable, "-c", "import os; from triton_omni_tools.bench.harness import "
                                f"keep_off; keep_off('{last}'); print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True).stdout
        assert f"vLLM engine cores on CPUs {last}" in moved
        assert moved.strip().splitlines()[-1] == str(sorted(os.sched_getaffinity(0) - {last}))


def test_the_encoder_queue_delay_reaches_the_servers_ar_encoder_and_none_keeps_the_repositorys(tmp_path):
    from dataclasses import replace

    from triton_omni_tools.bench import PRESETS
    from triton_omni_tools.launcher import DEFAULT_REPOSITORIES
    from triton_omni_tools.repository import load_config

    def delay(preset, dest):
        return _bench_config(preset, dest, "ar_encoder").dynamic_batching.max_queue_delay_microseconds

    shipped = load_config(DEFAULT_REPOSITORIES[0] / "ar_encoder" / "config.pbtxt")
    assert delay(PRESETS["tiny"], tmp_path / "a") == shipped.dynamic_batching.max_queue_delay_microseconds
    assert delay(replace(PRESETS["tiny"], encoder_queue_delay_us=750), tmp_path / "b") == 750


def test_output_lengths_are_drawn_per_client_within_the_range_and_repeat_for_the_same_client():
    import itertools
    from dataclasses import replace

    import pytest
    from triton_omni_tools.bench import PRESETS

    fixed = PRESETS["realistic"]
    assert set(itertools.islice(fixed.output_lengths(3), 50)) == {128}  # default: every request max_tokens
    spread = replace(fixed, output_range_ratio=0.5)
    lengths = list(itertools.islice(spread.output_lengths(3), 2000))
    assert min(lengths) >= 64 and max(lengths) <= 192 and len(set(lengths)) > 100
    assert abs(sum(lengths) / len(lengths) - 128) < 3  # the same mean work as the fixed length
    assert list(itertools.islice(spread.output_lengths(3), 2000)) == lengths  # both sides draw the same
    assert list(itertools.islice(spread.output_lengths(4), 20)) != lengths[:20]  # clients differ
    with pytest.raises(ValueError, match="output_range_ratio"):
        replace(fixed, output_range_ratio=1.0)


def test_the_mfu_peak_is_the_named_gpus_dense_bf16_one(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    from gpu_peaks import peak_bf16

    assert peak_bf16("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16("NVIDIA H200") == 989e12
    assert peak_bf16("CPU (x86_64)") is None
