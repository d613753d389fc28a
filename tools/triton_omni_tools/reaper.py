"""A launched process group dies with the process that launched it, however that one ends.

A tritonserver (with its stubs and their engine processes) or a gateway
started by this project runs in a process group of its own, so that
stopping it reaches everything it started. That also means nothing takes
it down if the launching process ends without stopping it: SIGKILL, the
default action of SIGTERM (a benchmark under ``timeout``, a cancelled CI
job), a crash. A killed benchmark once left its server and stubs running,
holding 26.6 GiB of a GPU, and the next server's memory plan failed.

Why not a handler, nor the kernel's parent-death signal alone: a handler
runs only if Python gets to run it (not after SIGKILL); ``PR_SET_PDEATHSIG``
fires when the *thread* that forked the child ends (a server started from a
worker thread would die with that thread), and reaches one process, not
the group.

How: the launcher starts a reaper (``python -m triton_omni_tools.reaper``)
before the group, in a session of its own (a signal to the launcher's group
does not reach it), with the read end of a pipe as its stdin. The launcher
alone holds the write end, and tells the reaper through it what to watch,
a JSON line per group. The kernel closes that end when the launcher's
process ends, whatever the cause; the reaper's read then returns, and it
kills the group, waits for it to be gone, and removes what the group left:
the ``/dev/shm`` files its processes mapped or named with the server's
prefixes, and the folders it was given. A launcher that stops its group
itself does the same work first, then tells the reaper to forget the group
(its number is free then, and may soon be another group's) and closes the
pipe: the reaper exits.

This module imports only the standard library and ``triton_omni.processes``
(standard library only too): the reaper starts in milliseconds, and the
launcher uses the same functions for its own stop.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

from triton_omni.processes import SHM, mapped_shared_memory

logger = logging.getLogger(__name__)


@dataclass
class Leftovers:
    """What a process group may leave behind: its processes, the ``/dev/shm``
    files named by these patterns (besides those its processes map), and these
    files or folders."""

    pgid: int
    shm_patterns: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)


def process_group(pgid: int) -> list[int]:
    """Live processes of a process group (server, stubs, engine processes); zombies are gone."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # exited meanwhile
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def kill_group(pgid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL to the whole group, and return once nothing of it is left.

    SIGKILL is delivered at once but a process with gigabytes mapped (a vLLM
    engine) takes a moment to exit. A group with no process left is not
    signalled: its number may belong to another group by now."""
    if not process_group(pgid):
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return  # already gone
    except PermissionError:
        logger.exception("Could not kill process group %d", pgid)
        return
    deadline = time.monotonic() + timeout_s
    while (left := process_group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        logger.warning("processes %s of group %d still exit after %.0f s", left, pgid, timeout_s)


def remove(files: set[Path], leftovers: Leftovers) -> None:
    """``files`` and whatever ``leftovers`` names (its ``/dev/shm`` patterns, its paths), if still there."""
    named = {match for pattern in leftovers.shm_patterns for match in SHM.glob(pattern)}
    for path in files | named | {Path(p) for p in leftovers.paths}:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def reap(leftovers: Leftovers, known: set[Path] = frozenset()) -> None:
    """Kill the group and remove everything it left: the shared memory its processes map (read
    before), ``known`` files seen mapped earlier, and what ``leftovers`` names."""
    mapped = mapped_shared_memory(process_group(leftovers.pgid))
    kill_group(leftovers.pgid)
    remove(known | mapped, leftovers)


class Reaper:
    """The launcher's side: a reaper process watching the groups this process launches."""

    def __init__(self):
        read_end, self._write_end = os.pipe()  # both non-inheritable; the child gets the read end as its stdin
        # env given (a copy): a child exec'd with the process's own environment reads it while it
        # execs, and a server started from a thread races any other thread setting a variable
        self.process = subprocess.Popen([sys.executable, "-m", "triton_omni_tools.reaper"], stdin=read_end,
                                        start_new_session=True, env=os.environ.copy())
        os.close(read_end)
        # A child forked without exec (a fork-based pool of the launcher's) would hold the write end
        # open, and the reaper would wait for that child too: it closes its copy as it starts.
        os.register_at_fork(after_in_child=functools.partial(_close_in_child, weakref.ref(self)))

    def watch(self, leftovers: Leftovers | None) -> None:
        """From now on, reap ``leftovers`` (in place of what it watched before; None: nothing) if this process ends."""
        os.write(self._write_end, (json.dumps(None if leftovers is None else asdict(leftovers)) + "\n").encode())

    def close(self) -> None:
        """Done: the group was stopped here. The reaper is told to watch nothing (the group's number
        is free, and may soon be another group's), and exits."""
        if self._write_end is not None:
            with contextlib.suppress(OSError):  # a reaper killed by hand: nothing to tell
                self.watch(None)
            os.close(self._write_end)
            self._write_end = None
            self.process.wait()


def _close_in_child(reaper: weakref.ref) -> None:
    if (live := reaper()) is not None and live._write_end is not None:
        with contextlib.suppress(OSError):
            os.close(live._write_end)
        live._write_end = None


def main() -> None:
    """Read what to watch from stdin until it closes (the launcher ended), then reap it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the launcher's end ends a reaper
    watched = None
    for line in sys.stdin:
        watched = None if (spec := json.loads(line)) is None else Leftovers(**spec)
    if watched is not None:
        try:
            reap(watched)
        except Exception:
            logger.exception("could not take down process group %d", watched.pgid)
            raise


if __name__ == "__main__":
    main()
