"""``benchmarks/dit_step.py`` on CPU with the tiny Wan: one forward of its DiT timed eagerly with
its attention projections unfused, then fused, then with the GELU epilogues (none on the CPU),
side by side in one run, each prediction's distance from the first. The report's shape is
checked, never a figure: docs/benchmarks.md quotes the GPU's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_forward_is_timed_unfused_then_fused(tmp_path):
    out_file = tmp_path / "dit_step.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dit_step.py"), "--family", "wan",
                             "--modes", "eager", "--projections", "unfused,fused,gelu-epilogue", "--repeats", "1",
                             "--json", str(out_file)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    points = json.loads(out_file.read_text())["points"]
    assert [p["projections"] for p in points] == ["unfused", "fused", "gelu-epilogue"]
    assert points[0]["ratio_to_first"] == 1 and all(p["seconds"] > 0 for p in points)
    assert points[0]["distance_from_first"] == 0 and points[1]["distance_from_first"] < 1e-4
    assert "fuse_projections: 4 attention layers fused" in result.stdout
    assert "fuse_gelu_epilogues: 0 feed-forward GELUs" in result.stdout  # float32 on the CPU: none


def test_fused_projections_are_refused_by_name_where_the_family_cannot_take_them():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dit_step.py"), "--family", "qwen-image",
                             "--projections", "fused"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 2 and "the qwen_image family's attention does not take" in result.stderr
