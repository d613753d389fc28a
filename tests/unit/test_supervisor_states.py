"""Which stub process states the supervisor reads as dead (tools/triton_omni_tools/supervisor.py)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from triton_omni_tools.supervisor import Stub, stat_fields


def _stub(state: str) -> Stub:
    return Stub(pid=1, model="ar", instance="ar_0_0", state=state, region="r")


@pytest.mark.parametrize("state", ["R", "S", "D", "t"])
def test_running_sleeping_and_traced_stubs_are_alive(state):
    # "t": py-spy stops the stub for every sample it takes; profiling must not get it killed
    assert _stub(state).alive


@pytest.mark.parametrize("state", ["Z", "T", "X"])
def test_zombie_stopped_and_dead_stubs_are_dead(state):
    assert not _stub(state).alive


def test_stat_fields_read_past_a_command_name_with_spaces_and_parentheses():
    assert stat_fields("4242 (python (x) y) S 17 4242 4242 0 -1") == ("S", 17)


def test_a_sigstopped_process_reads_as_dead():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline, state = time.monotonic() + 5, ""
        while time.monotonic() < deadline and state != "T":
            state, ppid = stat_fields(Path(f"/proc/{child.pid}/stat").read_text())
            time.sleep(0.05)
        assert ppid == os.getpid()
        assert not _stub(state).alive
    finally:
        child.kill()
        child.wait()
