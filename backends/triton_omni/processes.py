"""Which process is running, read from ``/proc`` (Linux), for the files that a
model's instances share: load records, seats in front of a shared engine; and
which ``/dev/shm`` files a set of processes maps, for whoever removes what a
killed process could not (the launcher, its reaper, the vLLM engine's stop).

A pid alone does not name a process for long: pids are reused, soon after a
restart of the machine or its container, whose ``/tmp`` may outlive it. A
seat file left by a server of an earlier boot named a pid that a live
process had taken again; the new server's instances took it for a sibling,
waited for it, and one of them ended a live engine core as "left behind"
(the test suite's server hung at start-up). So each file names a process by
its *identity*: its pid and its start time (clock ticks since boot).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

SHM = Path("/dev/shm")


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name; None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()  # the name may hold spaces and parentheses


def parents() -> dict[int, int]:
    """Every running process's parent pid, by pid."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) is not None:
            found[int(entry.name)] = int(fields[1])
    return found


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of its stat); None when it is gone."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def alive(pid: int | None, started: int | None = None) -> bool:
    """Running: not gone, and not a zombie (a killed stub stays one until the
    server reaps it); with ``started``, the very process that started then,
    not a later one that took its pid."""
    if pid is None:
        return False
    fields = stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return False
    return started is None or int(fields[19]) == started


def command_line(pid: int) -> bytes:
    """``/proc/<pid>/cmdline`` (arguments NUL-separated); empty when the process is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def identity(pid: int | None = None) -> str:
    """``"<pid>-<start ticks>"`` of a running process (this one by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{start_ticks(pid)}"


def identity_alive(ident: str) -> bool:
    """Whether the process an ``identity`` names is still running."""
    pid, _, started = ident.partition("-")
    return pid.isdigit() and started.isdigit() and alive(int(pid), int(started))


def server_folder(root: Path, prefix: str, server_pid: int | None = None) -> Path:
    """``root/<prefix>-<server identity>``: the folder the instances of one
    server share (``server_pid``: the tritonserver, the stub's parent). The
    ``<prefix>-*`` folders of servers no longer running are removed first."""
    server = identity(os.getppid() if server_pid is None else server_pid)
    for folder in root.glob(f"{prefix}-*"):
        owner = folder.name.removeprefix(f"{prefix}-")
        if owner != server and not identity_alive(owner):  # an earlier layout's names are never alive
            shutil.rmtree(folder, ignore_errors=True)
    return root / f"{prefix}-{server}"


def mapped_shared_memory(pids: list[int]) -> set[Path]:
    """The files directly in /dev/shm that these processes map: Python's
    ``multiprocessing`` segments and semaphores (``psm_*``, ``sem.mp-*``) that
    vLLM's engine core opens, the Python backend's regions. A process maps its
    own, and a forked child its parent's as well, so a file that no live
    process maps any more is garbage (a process that exits cleanly unlinks
    its own).

    Found by inode, not by the name in ``/proc/<pid>/maps``: glibc's
    ``sem_open`` maps a temporary file and links it under the semaphore's
    name, so the maps show the temporary name, already deleted."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue  # exited meanwhile
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and fields[5].count("/") == 3:
                inodes.add(int(fields[4]))
    found = set()
    for entry in os.scandir(SHM) if inodes else ():
        with contextlib.suppress(OSError):
            if entry.is_file(follow_symlinks=False) and entry.inode() in inodes:
                found.add(Path(entry.path))
    return found
