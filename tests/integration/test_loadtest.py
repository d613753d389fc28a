"""The Locust smoke run: both users, every task, zero failures."""

from __future__ import annotations

import csv
from pathlib import Path

from loadtest.run import run_locust


def test_locust_smoke_run_has_no_failures(server, tmp_path):
    prefix = tmp_path / "smoke"
    code = run_locust(server.http_url, server.grpc_url, prefix, users=4, run_time="20s",
                      extra_env={"OMNI_STEPS": "2", "OMNI_MAX_TOKENS": "4", "OMNI_WEIGHTS": "1,1,1"})
    with Path(f"{prefix}_stats.csv").open() as stats:
        rows = {row["Name"]: row for row in csv.DictReader(stats)}
    failures = Path(f"{prefix}_failures.csv").read_text()
    assert code == 0, failures
    assert int(rows["Aggregated"]["Failure Count"]) == 0, failures
    for protocol in ("http", "grpc"):
        assert any(name.startswith(protocol) and int(row["Request Count"]) > 0 for name, row in rows.items()), \
            f"no {protocol} requests ran"
