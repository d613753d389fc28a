"""``omni-triton bench --open-loop`` end to end on the tiny preset, cut short:
its own server with both diffusion modes, Poisson arrivals, mixed traffic.
The figures are a functional check here (a 2-core CPU); docs/benchmarks.md
has the GPU run."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
from PIL import Image
from triton_omni_tools.bench import PRESETS, openloop, openloop_plot


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a, b = openloop.poisson_arrivals(10.0, 2000, seed=3), openloop.poisson_arrivals(10.0, 2000, seed=3)
    assert np.array_equal(a, b) and np.all(np.diff(a) > 0)
    assert 9.0 < len(a) / a[-1] < 11.0


def test_open_loop_bench_measures_both_modes_and_mixed_traffic(tmp_path):
    preset = replace(PRESETS["tiny"], mixed_steps=(1, 3))
    # mixed traffic in the two modes the load points run: each other mode (step batching's other group
    # orders) is one more copy of `diffusion` in the server, through the same code here
    mixed_modes = ("request", "step")
    report = openloop.run(preset, "tiny", tmp_path, loads=(0.5,), requests=12, mixed_modes=mixed_modes)
    for mode in openloop.MODES:
        point = report["loads"][0.5][mode]
        assert point["requests"] == 12 and point["p99_ms"] >= point["p50_ms"] > 0
    readings = report["mixed"]
    # every mode at request batching's peak; the step modes (their group orders) again at their own
    assert list(readings["by_request_peak"]) == list(mixed_modes)
    assert list(readings["by_own_peak"]) == ["step"]
    for reading, results in readings.items():
        for mixed in results.values():
            assert mixed["peak_of"] == ("request" if reading == "by_request_peak" else "step")
            assert set(mixed["by_class"]) == {"1 steps 32px", "1 steps 64px", "3 steps 32px", "3 steps 64px"}
            assert sum(c["requests"] for c in mixed["by_class"].values()) == 12
            assert all(c["solo_ms"] > 0 for c in mixed["by_class"].values())
    assert report["peak_per_s"] > 0
    saved = json.loads((tmp_path / "open-loop.json").read_text())
    assert saved["requests"] == 12 and saved["complete"] is True
    with Image.open(tmp_path / "open-loop.png") as plot:  # three panels: load points, mixed traffic twice
        assert plot.format == "PNG" and plot.width == 3 * openloop_plot.PANEL_W
