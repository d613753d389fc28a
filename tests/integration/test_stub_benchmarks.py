"""The stub microbenchmarks end to end (``benchmarks/stub_tensors.py``,
``benchmarks/stub_metrics.py``): each starts a real server whose one model
times the stub's own calls (the figures docs/benchmarks.md quotes), and
prints them. Only the report's shape is checked here, never a time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_stub_tensors_benchmark_prints_every_figure_and_the_ratio():
    out = run_benchmark("stub_tensors.py", "--calls", "50")
    figures = re.findall(r"^(.+?)\s+([\d.]+) us$", out, re.MULTILINE)
    assert len(figures) == 4 and all(float(us) > 0 for _, us in figures)
    assert re.search(r"^token count, before / now: [\d.]+x$", out, re.MULTILINE)


def test_the_stub_metrics_benchmark_prints_each_kind_of_update_and_the_reference():
    out = run_benchmark("stub_metrics.py", "--calls", "50")
    for kind in ("histogram observe", "counter increment", "gauge set"):
        row = re.search(rf"^{kind}\s+([\d.]+) us\s+([\d.]+) us\s+([\d.]+)x$", out, re.MULTILINE)
        assert row, out
        assert float(row[1]) > 0 and float(row[2]) > 0
    assert re.search(r"^pure Python \(holds the GIL\)\s+[\d.]+x$", out, re.MULTILINE), out
