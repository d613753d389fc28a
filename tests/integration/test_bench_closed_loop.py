"""``omni-triton bench`` (the closed loop) end to end on the tiny preset, cut
short: the direct side stays loaded beside the server, and each point is
measured as direct/triton pairs in alternating order. The figures are a
functional check here (a 2-core CPU); docs/benchmarks.md has the GPU runs."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

from triton_omni_tools.bench import PRESETS, run


def test_closed_loop_bench_measures_each_point_in_alternating_pairs(tmp_path):
    # client_processes=1: both Triton clients in one process (`--client-processes`), as threads;
    # output lengths drawn per request (`--output-range-ratio`), the same on both sides
    [row] = run("tiny", concurrency=(2,), workloads=("ar",), out_dir=tmp_path, pairs=2, client_processes=1,
                output_range_ratio=0.5)

    points = json.loads((tmp_path / "points.json").read_text())
    # direct first in the first pair, triton first in the second: drift over the run cancels out
    assert [(p["side"], p["turn"]) for p in points] == [("direct", 0), ("triton", 0), ("triton", 1), ("direct", 1)]
    assert all(p["unit"] == "tokens" and p["throughput_per_s"] > 0 for p in points)
    assert all(p["stub_cores"] for p in points if p["side"] == "triton")  # measured in the window
    assert row["workload"] == "ar" and row["concurrency"] == 2 and len(row["ratios"]) == 2
    assert min(row["ratios"]) <= row["ratio"] <= max(row["ratios"])
    # every side generated exactly the drawn lengths: each client's warm-up request, then its rounds
    preset = replace(PRESETS["tiny"], output_range_ratio=0.5)
    rounds = preset.rounds_for("ar")
    drawn = sum(sum(itertools.islice(preset.output_lengths(client), 1, 1 + rounds)) for client in (0, 1))
    assert {p["tokens"] for p in points} == {drawn}
    assert drawn != 2 * rounds * preset.max_tokens  # the lengths did vary
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["pairs"] == 2 and report["rows"] == [row]
