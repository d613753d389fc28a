"""A mixed Locust soak with one stub killed midway (the `diffusion` stub,
which `text_to_image` and `omni`'s image route go through): every request
answered (a success or a typed error; none hangs past its deadline), the
server up, and tritonserver + stub memory and `/dev/shm` back within 10 %
(or 50 MB) of their level after warm-up. 60 s in `make test`, 10 minutes in
`make test-reliability`."""

from __future__ import annotations

import csv
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from triton_omni_tools.supervisor import server_stubs

from loadtest.run import run_locust
from tests.support.server import LONG_RELIABILITY, model_ready, xfail_if_triton_aborted_on_a_dead_stub

RUN_S = 600 if LONG_RELIABILITY else 40
# Four users with short think times keep the 2-core test machine busy. The load is
# not calibrated to a fraction of the server's capacity (the issue asks for ~80 %).
LOAD = {"OMNI_STEPS": "2", "OMNI_MAX_TOKENS": "8", "OMNI_WEIGHTS": "3,1,2", "OMNI_TIMEOUT_S": "30"}
# What a request may fail with while `diffusion` restarts: the stub's death (Triton's INTERNAL),
# the model away (NOT_FOUND, HTTP 400), or its deadline (a request lost with the stub).
TYPED = ("is not healthy", "unknown model", "not found", "no available versions", "Deadline", "timed out",
         "no response from", "HTTP 400", "HTTP 500", "HTTP 0", "INTERNAL", "UNAVAILABLE", "not ready")


def memory_mb(server) -> tuple[dict[str, float], float]:
    """(anonymous RSS of tritonserver and of each model's stubs, bytes in /dev/shm), in MB.

    Anonymous memory is where a leak shows. The weights a stub maps from its
    safetensors files are page cache: the kernel drops them from RSS when the
    host runs short and maps them in again on the next request, which moved
    the full RSS by 10 % with no leak on a busy CI host."""
    processes = [("tritonserver", server.process.pid),
                 *((stub.model, stub.pid) for stub in server_stubs(server.process.pid))]
    rss: dict[str, float] = {}
    for name, pid in processes:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    rss[name] = rss.get(name, 0.0) + int(line.split()[1]) / 1024
        except OSError:
            pass
    # allocated, not apparent, size: the stubs' regions are sparse files of 1 GB and more
    shm = sum(f.stat().st_blocks * 512 for f in Path("/dev/shm").iterdir() if f.is_file()) / 2**20
    return rss, shm


def locust(server, prefix: Path, run_s: int) -> dict:
    code = run_locust(server.http_url, server.grpc_url, prefix, users=4, run_time=f"{run_s}s", extra_env=LOAD)
    with Path(f"{prefix}_stats.csv").open() as stats:
        rows = {row["Name"]: row for row in csv.DictReader(stats)}
    with Path(f"{prefix}_failures.csv").open() as failed:
        failures = list(csv.DictReader(failed))
    return {"code": code, "total": int(rows["Aggregated"]["Request Count"]),
            "failed": int(rows["Aggregated"]["Failure Count"]), "failures": failures}



@pytest.mark.timeout(RUN_S + 300)  # past the suite's 600 s default: warm-up, the run, the restart
def test_soak_with_a_stub_killed_midway(supervised, tmp_path):
    warm = locust(supervised, tmp_path / "warm", 15)
    assert warm["failed"] == 0, warm["failures"][:3]
    rss_before, shm_before = memory_mb(supervised)

    def kill_midway():
        time.sleep(RUN_S / 2)
        [stub, *_] = [s for s in server_stubs(supervised.process.pid) if s.model == "diffusion"]
        os.kill(stub.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_midway)
    killer.start()
    soak = locust(supervised, tmp_path / "soak", RUN_S)
    killer.join()
    deadline = time.monotonic() + 60
    alive = lambda: supervised.process.poll() is None  # noqa: E731
    while not model_ready(supervised, "diffusion") and time.monotonic() < deadline and alive():
        time.sleep(0.5)
    xfail_if_triton_aborted_on_a_dead_stub(supervised)
    assert model_ready(supervised, "diffusion"), "diffusion not serving again"
    assert supervised.process.poll() is None, "tritonserver died"
    rss_after, shm_after = memory_mb(supervised)
    by_process = {name: f"{rss_before.get(name, 0):.0f} -> {mb:.0f}" for name, mb in rss_after.items()}
    rss_before, rss_after = sum(rss_before.values()), sum(rss_after.values())
    messages = [f"{f['Name']}: {f['Error']}" for f in soak["failures"]]
    print(f"soak {RUN_S} s: {soak['total']} requests, {soak['failed']} failed during the restart "
          f"({sorted(set(m[:100] for m in messages))}); RSS {rss_before:.0f} -> {rss_after:.0f} MB, "
          f"/dev/shm {shm_before:.0f} -> {shm_after:.0f} MB; RSS by process {by_process}")
    untyped = [m for m in messages if not any(t in m for t in TYPED)]
    assert not untyped, f"failures that are not typed errors: {untyped[:5]}"
    assert soak["total"] > soak["failed"] > 0 or soak["failed"] == 0
    assert rss_after <= rss_before + max(0.1 * rss_before, 50), by_process
    assert shm_after <= shm_before + max(0.1 * shm_before, 50), (shm_before, shm_after)
