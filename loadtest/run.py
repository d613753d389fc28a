"""`make loadtest`: the embedded server with the demo models, then Locust
headless with both users, CSVs in .cache/loadtest/ (omni_stats.csv, ...).

    .venv/bin/python loadtest/run.py [--users 8] [--run-time 60s] [--csv-prefix PATH]

Exits with Locust's exit code: non-zero when any request failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from triton_omni.demo_models import build_all
from triton_omni_tools.launcher import PROJECT_ROOT, ServerOptions, TritonServer

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def run_locust(http_url: str, grpc_url: str, csv_prefix: Path, users: int, run_time: str,
               extra_env: dict[str, str] | None = None) -> int:
    """Run both users headless against a server; returns Locust's exit code."""
    csv_prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--users", str(users),
               "--spawn-rate", str(users), "--run-time", run_time, "--host", f"http://{http_url}",
               "--csv", str(csv_prefix), "--only-summary", "--stop-timeout", "30"]
    env = os.environ | {"OMNI_GRPC_URL": grpc_url} | (extra_env or {})
    limit_s = _seconds(run_time) + 120  # run time, stop timeout, start-up
    try:
        return subprocess.run(command, env=env, check=False, timeout=limit_s).returncode
    except subprocess.TimeoutExpired:
        print(f"locust did not exit within {limit_s} s; killed", file=sys.stderr)
        return 124


def _seconds(run_time: str) -> int:
    """Locust's run time ("90s", "5m", "1h") in seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    return int(run_time[:-1]) * units[run_time[-1]] if run_time[-1] in units else int(run_time)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--run-time", default="60s")
    parser.add_argument("--csv-prefix", type=Path, default=PROJECT_ROOT / ".cache" / "loadtest" / "omni")
    args = parser.parse_args()
    build_all()
    options = ServerOptions(http_port=18000, grpc_port=18001, metrics_port=18002,
                            log_file=PROJECT_ROOT / ".cache" / "loadtest" / "server.log")
    with TritonServer(options) as server:
        code = run_locust(server.http_url, server.grpc_url, args.csv_prefix, args.users, args.run_time)
    print(f"CSVs: {args.csv_prefix}_stats.csv, _stats_history.csv, _failures.csv, _exceptions.csv")
    return code


if __name__ == "__main__":
    sys.exit(main())
