"""Several model instances in front of one vLLM engine core.

Why: an ``ar`` instance is one stub process, and one Python interpreter
runs all of its per-request work (vLLM's output processing and
detokenization, then our responses and their IPC to Triton) under one GIL,
and at high concurrency that interpreter can become the limit. vLLM's own answer to a busy frontend is several
API-server processes that share one engine core (``--api-server-count``);
this is that, with Triton instances as the frontends.

How: vLLM's engine core talks to each frontend over two ZeroMQ sockets that
the frontend binds (requests in, outputs out); the engine connects to all of
them and sends outputs back to the frontend a request came from. The
instances of a group agree on those addresses through a folder per model
and GPU set: each instance takes the lowest free *seat* under a file lock;
seat ``s`` is frontend ``s % frontends`` of engine ``s // frontends``. The
first frontend of an engine starts the engine core, with every frontend's
addresses, then connects as vLLM's own launcher would; the others connect
to theirs and wait for the engine's "ready", which it sends each frontend
as it comes up. A seat whose owner died is free again (a seat names its
owner by pid and start time, ``triton_omni.processes``: a pid reused by
another process does not keep it). The addresses carry
a token the first frontend drew, so that an engine of an earlier load,
left behind by a killed stub, never meets the new one's frontends.

Lifetimes: the engine core is a child of its first frontend's stub, shut
down with it. The other frontends watch its processes and fail their
requests with vLLM's ``EngineDeadError`` when they are gone; the
launcher's supervisor then reloads the whole model when a stub died. An
engine left running by a killed first frontend is ended by the next first
frontend of its seat, which needs its GPU memory.

This module is Triton-free: the caller names the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from triton_omni.processes import command_line, identity, identity_alive

logger = logging.getLogger(__name__)

MAX_SOCKET_PATH = 107  # bytes in a Unix socket path (sun_path), less its terminator


@dataclass(frozen=True)
class EngineSeat:
    """One instance's place in front of a shared engine core."""

    folder: Path
    engine: int  # which engine core of this folder
    frontend: int  # this instance's index among that engine's frontends
    frontends: int
    token: str  # drawn by the engine's first frontend; in every address of this engine

    @property
    def starts_engine(self) -> bool:
        return self.frontend == 0

    def input_address(self, frontend: int) -> str:
        return f"ipc://{self.folder}/e{self.engine}-{self.token}-in{frontend}"

    def output_address(self, frontend: int) -> str:
        return f"ipc://{self.folder}/e{self.engine}-{self.token}-out{frontend}"

    @property
    def client_addresses(self) -> dict[str, str]:
        """This frontend's sockets, as ``AsyncLLM(client_addresses=...)`` takes them."""
        return {"input_address": self.input_address(self.frontend),
                "output_address": self.output_address(self.frontend)}

    @property
    def engine_pid_file(self) -> Path:
        return _pid_file(self.folder, self.engine)

    def record_engine(self, pids: list[int]) -> None:
        """The first frontend: the engine core's processes, for the others to watch."""
        self.engine_pid_file.write_text(" ".join(identity(pid) for pid in pids))

    def release(self) -> None:
        """Give the seat back (a later load of the model takes it again); the
        first frontend, whose engine core has stopped by then, forgets its pids."""
        path = _seat_file(self.folder, self.engine * self.frontends + self.frontend)
        with _locked(self.folder), contextlib.suppress(FileNotFoundError):
            if _holder(path)[0] == identity():
                path.unlink()
                if self.starts_engine:
                    self.engine_pid_file.unlink()


def take_seat(folder: Path, frontends: int, timeout_s: float = 600.0) -> EngineSeat:
    """The lowest free seat of ``folder`` (created if need be), held by this
    process; a frontend other than the first waits (up to ``timeout_s``)
    for its engine's first frontend, whose token it needs."""
    if frontends < 1:
        raise ValueError(f"frontends must be at least 1, got {frontends}")
    folder.mkdir(parents=True, exist_ok=True)
    longest = len(f"ipc://{folder}/e99-{'0' * 8}-out{frontends - 1}") - len("ipc://")
    if longest > MAX_SOCKET_PATH:
        raise ValueError(f"the shared engine's socket folder {str(folder)!r} is too long for a Unix socket path "
                         f"({longest} > {MAX_SOCKET_PATH} bytes): set TMPDIR to a shorter folder")
    with _locked(folder):
        seat = 0
        while identity_alive(_holder(_seat_file(folder, seat))[0]):
            seat += 1
        engine, frontend = divmod(seat, frontends)
        token = secrets.token_hex(4) if frontend == 0 else ""
        _seat_file(folder, seat).write_text(f"{identity()} {token}")
        if frontend == 0:
            _end_leftover_engine(_pid_file(folder, engine))
    if frontend > 0:
        token = _first_frontend_token(_seat_file(folder, engine * frontends), timeout_s)
    return EngineSeat(folder, engine, frontend, frontends, token)


def watch_engine(seat: EngineSeat, on_exit, poll_s: float = 1.0) -> threading.Event:
    """Call ``on_exit()`` once when an engine process of ``seat`` (its pids
    as the first frontend wrote them) is gone. Set the returned event to stop."""
    stop = threading.Event()
    processes = seat.engine_pid_file.read_text().split()

    def watch() -> None:
        while not stop.wait(poll_s):
            if not all(identity_alive(process) for process in processes):
                logger.error("the shared vLLM engine core (%s) is gone; failing this frontend's requests",
                             " ".join(processes))
                on_exit()
                return

    threading.Thread(target=watch, name="omni-engine-watch", daemon=True).start()
    return stop


@contextlib.contextmanager
def _locked(folder: Path):
    with open(folder / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _seat_file(folder: Path, seat: int) -> Path:
    return folder / f"seat{seat}"


def _pid_file(folder: Path, engine: int) -> Path:
    return folder / f"e{engine}.pids"


def _holder(path: Path) -> tuple[str, str]:
    """(the holder's process identity, token) of a seat file; ("", "") when there is none."""
    try:
        holder, token = path.read_text().split(" ")
        return holder, token
    except (FileNotFoundError, ValueError):
        return "", ""


def _first_frontend_token(path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        holder, token = _holder(path)
        if identity_alive(holder) and token:
            return token
        if time.monotonic() > deadline:
            raise TimeoutError(f"no first frontend took {path} in {timeout_s:.0f} s: its engine core never started "
                               "(is the instance count a multiple of instances_per_engine?)")
        time.sleep(0.05)


def _end_leftover_engine(pid_file: Path) -> None:
    """Kill an engine core that a killed first frontend left behind (it holds GPU memory)."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        for process in pid_file.read_text().split():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                pid = int(process.partition("-")[0])
                # that very process (not one that took its pid since), and vLLM's (VLLM::EngineCore)
                if identity_alive(process) and command_line(pid).startswith(b"VLLM"):
                    logger.warning("ending vLLM engine core %d, left behind by a frontend that died", pid)
                    os.kill(pid, signal.SIGKILL)
        pid_file.unlink()
