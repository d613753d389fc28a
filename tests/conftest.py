"""What the whole suite shares: nothing it makes in /dev/shm, nor the project's folders in the
temporary folder, outlives the suite's servers and the processes that made it.

Checked once, after every other session-scoped fixture has stopped its servers (this one is set up
first, so it is torn down last): a leftover fails the run as an error in the last test's teardown,
naming the files. A tritonserver this process started and never stopped is a leftover too: its
files are in use while it runs, and the reaper only takes it down after pytest exits. An entry some
live process still uses is not a leftover (the pytest process's own multiprocessing objects, alive
until it exits; another server running beside the suite): a file it maps, a folder named in its
environment (a server's run folder, the gateway's metrics folder), a folder named after it
(``processes.server_folder``).

The runtime's run folder (``channel.run_dir``: cancel flags, stage errors, replies, progress
sockets) is each server's own, made and removed by the launcher; code run in the pytest process
itself, without a server, falls back to a per-user folder that outlives it by design. The suite
points that fallback at a folder of its own, removed at its end, so that a unit test leaves no
per-user folder on a machine that had none."""

from __future__ import annotations

import bisect
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from triton_omni.processes import alive, identity_alive, parents
from triton_omni_tools.reaper import SHM, mapped_shared_memory

PROJECT_TEMP_PREFIX = "triton-omni-"  # run folders, engine seats, the gateway's metrics folder
NAMED_BY_PROCESS = re.compile(r"triton-omni-(?:load|engines)-(\d+-\d+)$")
STARTED: list[tuple[float, str]] = []  # (when, test id) of every test's setup, in order


def pytest_runtest_setup(item):
    STARTED.append((time.time(), item.nodeid))


def made_during(entry: Path) -> str:
    """The test under way when ``entry`` last changed (for a shared-memory file: when it was made and sized)."""
    try:
        changed = entry.stat().st_ctime
    except OSError:
        return "gone meanwhile"
    index = bisect.bisect_right(STARTED, (changed, "\uffff")) - 1
    return STARTED[index][1] if index >= 0 else "before the first test"


def made_here() -> set[Path]:
    """Every /dev/shm entry, and the project's own entries in the temporary folder."""
    return {*SHM.iterdir(), *Path(tempfile.gettempdir()).glob(PROJECT_TEMP_PREFIX + "*")}


def in_use(entries: set[Path]) -> set[Path]:
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    environments = b""
    for pid in pids:
        try:
            environments += Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # gone meanwhile, or not ours to read
    used = mapped_shared_memory(pids)
    for entry in entries:
        named = NAMED_BY_PROCESS.match(entry.name)
        if (named and identity_alive(named[1])) or str(entry).encode() in environments:
            used.add(entry)
    return used


def servers_still_running() -> list[int]:
    """The tritonserver processes this pytest started (its children) that still run."""
    def name(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return ""  # gone meanwhile

    return [pid for pid, parent in parents().items()
            if parent == os.getpid() and alive(pid) and name(pid) == "tritonserver"]


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind():
    run = Path(tempfile.mkdtemp(prefix="triton-omni-suite-run-"))  # channel.run_dir() in this process
    os.environ["TRITON_OMNI_RUN_DIR"] = str(run)
    before = made_here()
    yield
    shutil.rmtree(run, ignore_errors=True)
    os.environ.pop("TRITON_OMNI_RUN_DIR", None)
    running = servers_still_running()
    assert not running, f"servers the suite started and never stopped: {running}"
    new = made_here() - before
    left = new - in_use(new)
    assert not left, "the suite left these behind: " + "; ".join(
        f"{entry} (made during {made_during(entry)})" for entry in sorted(left))
