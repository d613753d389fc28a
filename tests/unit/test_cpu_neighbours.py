"""benchmarks/cpu_neighbours.py end to end on this host's CPUs: a time for
every CPU alone and a line for each CPU kept busy. Only the report's shape is
checked, never a time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_neighbours.py"


def test_every_cpu_is_timed_alone_and_kept_busy_once():
    out = subprocess.run([sys.executable, str(SCRIPT), "--loops", "20000", "--reps", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    cpus = sorted(os.sched_getaffinity(0))
    alone = re.findall(r"(\d+):([\d.]+) \(([\d.]+)\)", out.splitlines()[0])
    assert [int(cpu) for cpu, _, _ in alone] == cpus and min(float(x) for _, _, x in alone) == 1.0
    busy = re.findall(r"^CPU (\d+) busy slows: (none|.+)$", out, re.MULTILINE)
    assert [int(cpu) for cpu, _ in busy] == cpus
