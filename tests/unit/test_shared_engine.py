"""Seats in front of a shared vLLM engine core (``triton_omni.ar.shared_engine``):
how the instances of a group agree on their sockets, without vLLM. The engine
itself is shared for real in tests/integration/test_ar_shared_engine.py."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from triton_omni.ar import ArRunnerConfig
from triton_omni.ar.shared_engine import take_seat, watch_engine
from triton_omni.processes import identity, start_ticks

from tests.support import fake_pb_utils

fake_pb_utils.install()

from triton_omni.triton.ar_io import engine_seat  # noqa: E402 - after the fake pb_utils
from triton_omni.triton.params import Placement  # noqa: E402

TAKE = """
import sys, time
from pathlib import Path
from triton_omni.ar.shared_engine import take_seat
seat = take_seat(Path(sys.argv[1]), 2)
print(seat.engine, seat.frontend, seat.token, seat.client_addresses["input_address"], flush=True)
time.sleep(3)  # hold the seat while the others take theirs
"""


def test_each_instance_takes_its_own_seat_and_shares_the_first_frontends_token(tmp_path):
    """Four processes at once, two frontends per engine: engines 0 and 1,
    frontends 0 and 1 of each, each engine's addresses under its first frontend's token."""
    procs = [subprocess.Popen([sys.executable, "-c", TAKE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    seats = sorted(tuple(proc.communicate(timeout=60)[0].split()) for proc in procs)
    assert [(engine, frontend) for engine, frontend, _, _ in seats] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert seats[0][2] == seats[1][2] != seats[2][2] == seats[3][2]
    assert len({address for *_, address in seats}) == 4


def test_a_seat_whose_holder_died_is_free_and_a_released_one_too(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "seat0").write_text(f"{int(dead.stdout)}-1 cafe0000")
    first = take_seat(tmp_path, 2)
    assert (first.engine, first.frontend) == (0, 0) and first.token != "cafe0000"
    second = take_seat(tmp_path, 2)  # this process again: the next seat, the first one's token
    assert (second.frontend, second.token) == (1, first.token)
    second.release()
    assert take_seat(tmp_path, 2).frontend == 1
    first.record_engine([12345])
    first.release()
    assert not first.engine_pid_file.exists()


def test_seats_and_engines_of_an_earlier_boot_whose_pids_were_reused_are_left_alone(tmp_path):
    """Files left in /tmp by a server before a restart name pids that live
    processes hold again: the seat is free, and the live process that took
    the recorded engine pid (here one titled as vLLM's) is not killed. Seen:
    the test suite's server hung at start-up, and a live engine core died."""
    taken = subprocess.Popen(["VLLM::EngineCore", "60"], executable="/bin/sleep")
    try:
        earlier = f"{taken.pid}-{start_ticks(taken.pid) - 1}"  # the same pid, an earlier process
        (tmp_path / "seat0").write_text(f"{earlier} cafe0000")
        (tmp_path / "e0.pids").write_text(earlier)
        seat = take_seat(tmp_path, 2)
        assert (seat.engine, seat.frontend) == (0, 0) and seat.token != "cafe0000"
        assert taken.poll() is None and not seat.engine_pid_file.exists()
        seat.record_engine([taken.pid])  # the very process: a later first frontend ends it
        seat.release()
        (tmp_path / "e0.pids").write_text(identity(taken.pid))
        take_seat(tmp_path, 2)
        assert taken.wait(timeout=30) == -9  # a loaded CI host was seen to take over 5 s
    finally:
        taken.kill()


def test_a_later_frontend_waits_for_its_first_frontend_and_says_why_it_gave_up(tmp_path):
    (tmp_path / "seat0").write_text(f"{identity()} ")  # held, but no token: never a first frontend
    with pytest.raises(TimeoutError, match="instance count a multiple of instances_per_engine"):
        take_seat(tmp_path, 2, timeout_s=0.2)


def test_a_folder_too_long_for_a_unix_socket_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="too long for a Unix socket path"):
        take_seat(tmp_path / ("x" * 120), 2)


def test_the_other_frontends_hear_when_the_engine_core_is_gone(tmp_path):
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seat = take_seat(tmp_path, 2)
    seat.record_engine([engine.pid])
    gone = threading.Event()
    stop = watch_engine(seat, on_exit=gone.set, poll_s=0.05)
    assert not gone.wait(0.3)
    engine.kill()
    engine.wait()
    assert gone.wait(5)
    stop.set()


def test_instances_per_engine_is_checked_at_load_with_the_numbers():
    vllm = ArRunnerConfig(model="m", engine="vllm")
    config = {"name": "ar", "parameters": {"instances_per_engine": {"string_value": "2"}},
              "instance_group": [{"kind": "KIND_GPU", "count": 3}]}
    with pytest.raises(ValueError, match="multiple of 2; the config has count 3"):
        engine_seat(config, vllm, Placement("cuda", (0,)))
    with pytest.raises(ValueError, match="needs the vLLM engine"):
        engine_seat(config, ArRunnerConfig(model="m", engine="transformers"), Placement("cpu"))
    config["parameters"]["instances_per_engine"]["string_value"] = "two"
    with pytest.raises(ValueError, match="whole number >= 1, got 'two'"):
        engine_seat(config, vllm, Placement("cpu"))
    config["parameters"]["instances_per_engine"]["string_value"] = "1"
    assert engine_seat(config, vllm, Placement("cpu")) is None
