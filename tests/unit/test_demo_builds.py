"""``ensure_built``: processes asking for one demo model at once (a server's instances, the tests'
processes beside each other) get one build between them, and none of them ever sees a complete
build removed. Before the lock each built its own and renamed it over the other's, removing a
folder another process was reading (an integration server's start failed that way)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from triton_omni import demo_models

# A builder that takes its time and leaves a trace of each build: two processes at once overlap.
BUILD = """
import sys, time
from pathlib import Path
from triton_omni.demo_models import ensure_built

def slow(out: Path) -> None:
    with open(sys.argv[1], "a") as log:
        log.write("build\\n")
    time.sleep(1.0)
    (out / "weights").write_text("complete")

target = ensure_built("slow-demo", slow)
print((target / "weights").read_text())
"""


def test_processes_at_once_share_one_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_OMNI_CACHE", str(tmp_path / "cache"))
    builds = tmp_path / "builds.log"
    processes = [subprocess.Popen([sys.executable, "-c", BUILD, str(builds)], stdout=subprocess.PIPE, text=True)
                 for _ in range(3)]
    outputs = [process.communicate(timeout=120)[0].strip() for process in processes]
    assert [process.returncode for process in processes] == [0, 0, 0]
    assert outputs == ["complete"] * 3
    assert builds.read_text().splitlines() == ["build"]  # one build; the others waited for it


def test_a_complete_build_is_never_removed_under_a_reader(tmp_path, monkeypatch):
    """Threads, each with its own lock handle: one reads the build while the others ask for it."""
    monkeypatch.setenv("TRITON_OMNI_CACHE", str(tmp_path))
    calls = []

    def builder(out):
        calls.append(out)
        time.sleep(0.2)
        (out / "weights").write_text("complete")

    seen, start = [], threading.Barrier(4)

    def ask():
        start.wait()
        target = demo_models.ensure_built("shared-demo", builder)
        for _ in range(20):  # a reader keeps reading while the others return
            seen.append((target / "weights").read_text())
            time.sleep(0.01)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and seen == ["complete"] * 80


def test_an_older_or_unfinished_build_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_OMNI_CACHE", str(tmp_path))
    target = tmp_path / "models" / "old-demo"
    target.mkdir(parents=True)
    (target / "weights").write_text("stale")  # no stamp: a build cut short
    built = demo_models.ensure_built("old-demo", lambda out: (out / "weights").write_text("fresh"))
    assert built == target and (target / "weights").read_text() == "fresh"
    (target / ".built").write_text("0")  # an older build version
    demo_models.ensure_built("old-demo", lambda out: (out / "weights").write_text("newer"))
    assert (target / "weights").read_text() == "newer"
