"""The perf_analyzer wrapper's handling of the tool's own quirks, against a
stand-in script (the real tool runs in tests/integration/test_perf_analyzer.py)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from triton_omni_tools.perf import EXPORT_ATTEMPTS, PerfError, PerfRun, perf_analyzer

EXPORT = {"experiments": [{"requests": [{"timestamp": 0, "response_timestamps": [2_000_000]},
                                        {"timestamp": 1_000_000, "response_timestamps": [5_000_000]}]}]}


def stand_in(tmp_path: Path, empty_runs: int) -> Path:
    """A perf_analyzer that exits 0 and leaves its export empty ``empty_runs`` times, then writes it."""
    script = tmp_path / "perf_analyzer"
    counter = tmp_path / "runs"
    script.write_text(f"""#!/bin/sh
export_file=$(echo "$@" | sed 's/.*--profile-export-file \\([^ ]*\\).*/\\1/')
echo x >> {counter}
if [ $(wc -l < {counter}) -le {empty_runs} ]; then : > "$export_file"
else echo '{json.dumps(EXPORT)}' > "$export_file"; fi
echo "Request count: 2"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_an_empty_export_is_measured_again(tmp_path):
    result = perf_analyzer("localhost:1", PerfRun("ar", "ar_vllm", streaming=True), tmp_path / "out",
                           binary=stand_in(tmp_path, empty_runs=1))
    assert result.requests == 2
    assert result.p99_latency_ms == pytest.approx(4.0)
    assert (tmp_path / "runs").read_text().count("x") == 2
    assert "--- attempt 2" in (tmp_path / "out" / "ar_vllm.perf_analyzer.log").read_text()


def test_an_export_that_stays_empty_is_an_error(tmp_path):
    with pytest.raises(PerfError, match="empty"):
        perf_analyzer("localhost:1", PerfRun("ar", "ar_vllm", streaming=True), tmp_path / "out",
                      binary=stand_in(tmp_path, empty_runs=EXPORT_ATTEMPTS))
