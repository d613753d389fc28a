"""``benchmarks/dit_step.py`` on CPU with the tiny Wan: one forward of its DiT timed eagerly with
its attention projections unfused, then fused, side by side in one run. The report's shape is
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
                             "--modes", "eager", "--projections", "unfused,fused", "--repeats", "1",
                             "--json", str(out_file)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    points = json.loads(out_file.read_text())["points"]
    assert [p["projections"] for p in points] == ["unfused", "fused"]
    assert points[0]["ratio_to_first"] == 1 and all(p["seconds"] > 0 for p in points)
    assert "fuse_projections: 4 attention layers fused" in result.stdout


def test_fused_projections_are_refused_by_name_where_the_family_cannot_take_them():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dit_step.py"), "--family", "qwen-image",
                             "--projections", "fused"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 2 and "the qwen_image family's attention does not take" in result.stderr
