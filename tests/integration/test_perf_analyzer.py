"""Triton's perf_analyzer (the 2.51.0 release, matching the server) drives the
models with zero errors: `ar_encoder`, and `ar` with the inputs genai-perf
sends for `--backend vllm` and `--backend tensorrtllm`. `make perf` runs the
full set and genai-perf itself."""

from __future__ import annotations

import pytest
from triton_omni_tools.perf import PerfRun, perf_analyzer

SMOKE_RUNS = [PerfRun("ar_encoder", "ar_encoder"), PerfRun("ar", "ar_vllm", streaming=True),
              PerfRun("ar", "ar_tensorrtllm", streaming=True)]


@pytest.mark.parametrize("run", SMOKE_RUNS, ids=lambda run: run.data)
def test_perf_analyzer_runs_without_errors(grpc_url, tmp_path, run):
    result = perf_analyzer(grpc_url, run, tmp_path, concurrency=2, request_count=10)
    assert result.requests == 10
    assert result.throughput > 0
    assert (tmp_path / f"{run.data}.perf_analyzer.json").exists()
