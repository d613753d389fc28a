"""``omni-triton bench --gpus`` end to end on the tiny preset, cut short: its
own server, the closed loop, diffusion's counters per device and the table.
On this CPU only ``--gpus 1`` exists (the defaults), so this checks the
harness; docs/benchmarks.md has the run on two H200s."""

from __future__ import annotations

import json
from dataclasses import replace

from triton_omni_tools.bench import PRESETS, scaling


def test_scaling_bench_measures_diffusion_with_its_counters(tmp_path):
    preset = replace(PRESETS["tiny"], workloads=("diffusion",))
    [row] = scaling.run(preset, "tiny", (1,), tmp_path, concurrency=(2,))
    assert (row["workload"], row["gpus"], row["concurrency"]) == ("diffusion", 1, 2)
    assert row["scaling"] == 1.0 and row["per_s"] > 0
    [point] = json.loads((tmp_path / "gpus.json").read_text())["points"]
    assert point["requests"] == 2 * scaling.IMAGE_ROUNDS
    # every step of every timed request, on the CPU; no CUDA graphs there
    assert point["counters"] == {"steps_cpu": 2 * scaling.IMAGE_ROUNDS * preset.steps, "graph_captures": 0}
    # the stubs' CPU in the window: diffusion's did the denoising; ar_encoder's (loaded for the embeddings) idled
    cores = point["stub_cores"]
    assert set(cores) == {"ar_encoder", "diffusion"}
    assert cores["diffusion"] > cores["ar_encoder"] >= 0  # not a fixed share: a loaded host gives less
