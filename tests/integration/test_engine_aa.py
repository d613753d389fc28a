"""``benchmarks/engine_aa.py`` end to end on CPU: two identical vLLM engines
(the bench's direct side of ``ar``, or of ``ar_encoder``, twice) measured in pairs, the order
alternating. Only the report's shape is checked, never a ratio: the figure
docs/benchmarks.md quotes is what a GPU host can resolve."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# `ar` only: `--workload ar_encoder` runs the same pairing code over the encoder's direct side, and
# two more vLLM engine starts would cost the suite about a minute.
def test_two_identical_engines_are_measured_in_alternating_pairs(tmp_path, workload="ar"):
    out_file = tmp_path / "aa.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_aa.py"), "--workload", workload,
                             "--preset", "tiny", "--concurrency", "2", "--pairs", "2", "--out", str(out_file)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    pairs = re.findall(r"^c=2 pair (\d) \((A then B|B then A)\): .* B / A ([\d.]+)$", result.stdout, re.MULTILINE)
    assert [(turn, order) for turn, order, _ in pairs] == [("1", "A then B"), ("2", "B then A")]
    assert re.search(r"^c=2: B / A median [\d.]+, range [\d.]+ to [\d.]+$", result.stdout, re.MULTILINE)
    records = json.loads(out_file.read_text())
    assert [r["order"] for r in records] == [["A", "B"], ["B", "A"]]
    assert all(r[side]["throughput_per_s"] > 0 for r in records for side in "AB")
