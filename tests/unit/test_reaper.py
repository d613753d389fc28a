"""The reaper (reaper.py) on plain processes: what it watches dies with the process that started it,
even while a child forked from that process lives on; a group that its launcher stopped is left
alone, whatever takes its number next."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from triton_omni_tools.reaper import Leftovers, Reaper, process_group

# A launcher: a group of its own watched by a reaper, a child forked without exec (as a fork-based
# pool's worker), then it dies without a word.
LAUNCHER = """
import os, subprocess, sys, time
from triton_omni_tools.reaper import Leftovers, Reaper
reaper = Reaper()
group = subprocess.Popen(["sleep", "120"], start_new_session=True)
reaper.watch(Leftovers(group.pid))
forked = os.fork()
if forked == 0:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the test reads the launcher's output to its end
    os.dup2(devnull, 2)
    time.sleep(120)
    os._exit(0)
print(group.pid, forked, flush=True)
os.kill(os.getpid(), 9)
"""


def wait_gone(pgid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not process_group(pgid)


def test_the_group_dies_with_its_launcher_while_a_forked_child_lives():
    launcher = subprocess.run([sys.executable, "-c", LAUNCHER], capture_output=True, text=True, timeout=60)
    pgid, forked = map(int, launcher.stdout.split())
    try:
        assert wait_gone(pgid), "the watched group outlived its launcher"
        assert os.path.exists(f"/proc/{forked}"), "the forked child should still run (it holds no pipe end)"
    finally:
        os.kill(forked, signal.SIGKILL)


def test_a_group_its_launcher_stopped_is_left_alone():
    """close() says the group was stopped here: its number is free, the next holder is not the reaper's."""
    reaper = Reaper()
    group = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        reaper.watch(Leftovers(group.pid))
        reaper.close()
        assert reaper.process.returncode == 0
        assert group.poll() is None, "the reaper killed a group it was told to forget"
    finally:
        group.kill()
        group.wait()
