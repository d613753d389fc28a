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


class _Api:
    def __init__(self, ready):
        self.ready = set(ready)

    def ready_models(self):
        return self.ready


def test_a_model_that_lost_one_of_its_stubs_is_found_dead(monkeypatch, tmp_path):
    """Two instances; one stub killed and reaped, the other alive: its shared-memory
    region left behind says it died. A stub that exits cleanly takes its region along."""
    from triton_omni_tools import supervisor as module

    regions = tmp_path / "shm"
    regions.mkdir()
    monkeypatch.setattr(module, "Path", lambda *parts: regions.joinpath(*parts[1:]) if parts[0] == "/dev/shm"
                        else Path(*parts))
    first, second = (Stub(pid, "ar", f"ar_0_{i}", "S", f"region{i}") for i, pid in enumerate((101, 102)))
    for stub in (first, second):
        (regions / stub.region).touch()
    now = [first, second]
    monkeypatch.setattr(module, "server_stubs", lambda server_pid: list(now))
    sup = module.Supervisor(1, _Api({"ar"}), tmp_path)
    sup.python_models, sup._last_seen = {"ar"}, {s.pid: s for s in now}
    restarted = []
    monkeypatch.setattr(sup, "restart", lambda model, stubs, gone=(): restarted.append((model, stubs, gone)))
    assert sup.check() == []
    now.remove(second)  # killed: gone, its region left behind
    assert sup.check() == ["ar"]
    assert restarted == [("ar", [first], [second])]
    now.remove(first)
    (regions / first.region).unlink()  # exited cleanly
    sup.api.ready = set()  # unloaded on purpose
    assert sup.check() == []
