"""``benchmarks/stub_tensors.py`` end to end: it starts a real server whose
one model times the ways of building a streamed ``ar`` response inside the
stub (the figures docs/benchmarks.md quotes), and prints them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_stub_tensors_benchmark_prints_every_figure_and_the_ratio():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stub_tensors.py"), "--calls", "50"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = re.findall(r"^(.+?)\s+([\d.]+) us$", result.stdout, re.MULTILINE)
    assert len(figures) == 4 and all(float(us) > 0 for _, us in figures)
    assert re.search(r"^token count, before / now: [\d.]+x$", result.stdout, re.MULTILINE)
