"""``benchmarks/step_cache.py`` end to end on CPU with the tiny pipelines: the
same requests with the step cache off and on, at concurrency 1 and 2. The
report's shape is checked (a speed-up, the quality cost, the steps each
request skipped), never a ratio: docs/benchmarks.md quotes the GPU figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("family", "threshold"), [("qwen-image", "0.4"), ("z-image", "0.8")])
def test_the_step_cache_is_measured_against_no_cache(tmp_path, family, threshold):
    out_file = tmp_path / "step_cache.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_cache.py"), "--family", family,
                             "--threshold", threshold, "--concurrency", "1,2", "--json", str(out_file)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speed-up" in result.stdout and "min PSNR dB" in result.stdout
    report = json.loads(out_file.read_text())
    assert report["method"] == f"first_block:{threshold}"
    for point in report["points"]:
        assert point["off_s"] > 0 and point["on_s"] > 0 and point["psnr_db"] > 0
        assert len(point["skipped"]) == point["concurrency"] and all(0 < s < point["steps"] for s in point["skipped"])
