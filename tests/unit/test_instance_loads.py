"""Join-the-shortest-queue over a model's instances (triton/balance.py): an
instance more loaded than its least loaded sibling holds ``execute``."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading

import pytest
from triton_omni.processes import identity, start_ticks
from triton_omni.triton.balance import DEFAULT_FULL_HOLD_S, InstanceLoads, full_hold_s, instance_count


def loads(tmp_path, name: str, **options) -> InstanceLoads:
    return InstanceLoads("diffusion", name, server_pid=1, root=tmp_path, **options)


def test_a_single_instance_never_holds(tmp_path):
    alone = loads(tmp_path, "diffusion_0_0")
    alone.add(5)
    assert alone.siblings() == []
    assert alone.hold() == 0


def test_the_more_loaded_instance_holds_until_it_finishes_a_request(tmp_path):
    busy, idle = loads(tmp_path, "diffusion_0_0", max_hold_s=10), loads(tmp_path, "diffusion_0_1")
    busy.add(2)
    idle.add(1)
    assert busy.siblings() == [1] and idle.siblings() == [2]
    assert idle.hold() < 0.1  # the least loaded instance takes work at once
    threading.Timer(0.2, busy.add, (-1,)).start()  # as loaded as its sibling: free again
    assert 0.15 < busy.hold() < 5


def test_the_more_loaded_instance_holds_until_a_sibling_takes_work(tmp_path):
    busy, idle = loads(tmp_path, "diffusion_0_0", max_hold_s=10), loads(tmp_path, "diffusion_0_1")
    busy.add(1)
    threading.Timer(0.2, idle.add, (1,)).start()  # Triton gave the sibling the next request
    assert 0.15 < busy.hold() < 5


def test_a_hold_is_bounded(tmp_path):
    busy = loads(tmp_path, "diffusion_0_0", max_hold_s=0.2)
    loads(tmp_path, "diffusion_0_1")  # a sibling that never takes anything (hung)
    busy.add(4)
    assert 0.2 <= busy.hold() < 2


def test_a_full_instance_holds_until_it_has_room_even_when_least_loaded(tmp_path):
    full, busier = loads(tmp_path, "diffusion_0_0"), loads(tmp_path, "diffusion_0_1")
    full.add(2)
    busier.add(3)
    room = threading.Event()
    threading.Timer(0.2, room.set).start()  # one of its requests finished
    assert 0.15 < full.hold(full=lambda: not room.is_set()) < 5


def test_a_full_hold_is_bounded(tmp_path):
    full = loads(tmp_path, "diffusion_0_0", max_full_hold_s=0.2)
    loads(tmp_path, "diffusion_0_1").add(9)
    assert 0.2 <= full.hold(full=lambda: True) < 2


@pytest.mark.parametrize(("raw", "seconds"), [(None, DEFAULT_FULL_HOLD_S), ("", DEFAULT_FULL_HOLD_S), ("600", 600.0),
                                              (" 0.5 ", 0.5)])
def test_the_full_hold_comes_from_the_model_parameter(raw, seconds):
    assert full_hold_s({} if raw is None else {"full_hold_s": raw}) == seconds


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "nan", "inf"])
def test_a_full_hold_that_is_no_duration_fails_the_load_naming_it(raw):
    with pytest.raises(ValueError, match="model parameter 'full_hold_s' must be a number of seconds above 0"):
        full_hold_s({"full_hold_s": raw})


def test_a_full_instance_alone_never_holds(tmp_path):
    """With one instance its engine's own queue is the only queue: nothing to gain."""
    assert loads(tmp_path, "diffusion_0_0").hold(full=lambda: True) == 0


def test_a_dead_siblings_load_is_ignored_and_its_file_removed(tmp_path):
    busy = loads(tmp_path, "diffusion_0_0")
    busy.add(4)
    # a sibling in another process, which then dies (as a killed stub does)
    code = ("from pathlib import Path; from triton_omni.triton.balance import InstanceLoads; "
            f"InstanceLoads('diffusion', 'diffusion_0_1', server_pid=1, root=Path({str(tmp_path)!r}))")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert len(list(busy.folder.iterdir())) == 2
    assert busy.siblings() == []
    assert [p.name for p in busy.folder.iterdir()] == [busy.name]
    assert busy.hold() == 0


def test_the_last_instance_out_removes_the_folder(tmp_path):
    first, second = loads(tmp_path, "diffusion_0_0"), loads(tmp_path, "diffusion_0_1")
    first.close()
    assert second.folder.exists() and second.siblings() == []
    second.close()
    assert not second.folder.exists()


def test_folders_of_servers_that_are_gone_are_removed(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"triton-omni-load-{gone.pid}-1" / "diffusion"
    reused = tmp_path / f"triton-omni-load-{os.getpid()}-{start_ticks(os.getpid()) - 1}" / "diffusion"  # a past boot
    older = tmp_path / f"triton-omni-load-{gone.pid}-diffusion"  # this module's former layout
    for folder in (stale, reused, older):
        folder.mkdir(parents=True)
    live = loads(tmp_path, "diffusion_0_0")
    assert not stale.parent.exists() and not reused.parent.exists() and not older.exists()
    assert live.folder == tmp_path / f"triton-omni-load-{identity(1)}" / "diffusion"


def test_a_record_whose_pid_now_names_another_process_is_no_sibling(tmp_path):
    """After a restart a left-over record's pid may be a live process again:
    its start time tells them apart (a phantom sibling at load 0 made every
    execute wait its max_hold_s)."""
    live = loads(tmp_path, "diffusion_0_0")
    live.add(3)
    phantom = live.folder / f"diffusion_0_1.{os.getpid()}"
    phantom.write_bytes(struct.pack("<qqq", os.getpid(), start_ticks(os.getpid()) + 1, 0))
    assert live.siblings() == [] and not phantom.exists()
    assert live.hold() == 0


def test_a_model_with_one_instance_neither_writes_its_load_nor_looks_for_siblings(tmp_path):
    alone = loads(tmp_path, "ar_0", instances=1)
    stale = loads(tmp_path, "ar_1")  # a record the lone instance must not wait on (a reload's leftover)
    alone.add(3)
    assert alone.hold() == 0 and alone.load == 3
    assert stale.siblings() == [0]  # nothing written per request: nobody reads it


@pytest.mark.parametrize(("groups", "count"), [
    ([{"kind": "KIND_MODEL", "count": 1}], 1),
    ([{"kind": "KIND_CPU", "count": 2}], 2),
    ([{"kind": "KIND_GPU", "count": 1, "gpus": [0, 1]}, {"kind": "KIND_CPU", "count": 1}], 3),
    ([{"kind": "KIND_GPU", "count": 2}], None),  # on every GPU Triton sees: not known here
    ([], None),
])
def test_the_instance_count_comes_from_the_config(groups, count):
    assert instance_count({"instance_group": groups}) == count
