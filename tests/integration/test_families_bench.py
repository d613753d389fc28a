"""``benchmarks/families.py`` end to end on CPU with the tiny pipelines: each
family through Triton against diffusers' own pipeline, the same embeddings
and seeds. The report's shape is checked, and that the served image at
concurrency 1 is the pipeline's; never a ratio (docs/benchmarks.md quotes the
GPU figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family", ["qwen-image", "z-image"])
def test_the_family_is_measured_against_its_pipeline(tmp_path, family):
    out_file = tmp_path / "families.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "families.py"), "--family", family,
                             "--rounds", "1", "--concurrency", "1,2", "--json", str(out_file)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "throughput t/d" in result.stdout
    report = json.loads(out_file.read_text())
    assert [p["concurrency"] for p in report["points"]] == [1, 2]
    for point in report["points"]:
        assert point["direct"]["images_per_s"] > 0 and point["triton"]["images_per_s"] > 0
    assert report["points"][0]["first_image_max_diff"] == 0  # alone, the served image is the pipeline's
