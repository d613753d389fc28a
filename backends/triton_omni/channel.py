"""The side channel between the scheduler and the stages it calls.

What a BLS call cannot carry in Triton 2.51: progress from inside a
non-decoupled model (diffusion steps), cancellation of a request the
scheduler sent (``InferenceRequest`` has no cancel before python_backend
24.12), a reply still being written, and a stage's error in the middle of a
stream. All go through a private run directory that every model process of
one server shares:

* progress: the scheduler listens on a Unix datagram socket
  ``<run dir>/<listener>.sock``; a stage sends ``"<key> <step> <total>"`` to
  it, fire and forget (progress is advisory: a lost datagram loses one tick).
* cancellation: the scheduler creates ``<run dir>/<key>.cancel``; a stage
  checks for it between steps or tokens, next to its own ``is_cancelled``.

* a reply as it is written: the scheduler writes the thinker's token ids
  to ``<run dir>/<id>.reply`` as they come (a line of ids at a time, then
  ``end``, or ``abort``), so that ``speech`` starts speaking at the reply's
  first token; Triton streams a decoupled model's responses, never a
  request's inputs. Where the talker reads the thinker's states (Qwen2.5-Omni's),
  they go to ``<run dir>/<id>.states`` as float32 rows, each batch written
  before the line of ids it came with, so a reader that has read ``end``
  finds every row there.

* a stage's error in the middle of a stream: Triton 2.51's BLS loses an
  error response that is not its stream's first, final flag and all
  (python_backend 24.10 saves a response's id only when it has no error;
  fixed in 25.04), and the scheduler would wait for that stream's end for
  good. So a stage answering the scheduler writes such an error to
  ``<run dir>/<key>.error`` and ends the stream with a final flag alone; the
  scheduler reads the file at the stream's end (``StageErrors``).

Keys and listener names are random 32-hex-digit ids sent as request
parameters (``omni_key``, ``omni_progress``, ``omni_reply``). Anything else is ignored, so a
client setting those parameters can neither pick a path nor cancel a request
whose key it does not know.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

KEY_PARAMETER = "omni_key"
PROGRESS_PARAMETER = "omni_progress"
REPLY_PARAMETER = "omni_reply"
_ID = re.compile(r"[0-9a-f]{32}")


def run_dir(create: bool = True) -> Path:
    """``$TRITON_OMNI_RUN_DIR`` (the launcher makes one per server), else a
    per-user directory in the system temp dir; private either way. ``create``: made
    if it is not there (a reader that finds nothing there needs none made)."""
    path = Path(os.environ.get("TRITON_OMNI_RUN_DIR") or Path(tempfile.gettempdir()) / f"triton-omni-{os.getuid()}")
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def restarts_file(run: Path, model: str) -> Path:
    """Where the launcher's supervisor counts a model's restarts (the model reports it as a metric)."""
    return run / "restarts" / model


def restart_count(model: str) -> int:
    """How many times the supervisor has restarted ``model`` on this server (0 without one)."""
    try:
        return int(restarts_file(run_dir(create=False), model).read_text())
    except (OSError, ValueError):
        return 0


def new_id() -> str:
    return uuid.uuid4().hex


def valid_id(value: object) -> str | None:
    return value if isinstance(value, str) and _ID.fullmatch(value) else None


class Cancellations:
    """Cancel flags shared across processes, one file per key."""

    def __init__(self, directory: Path | None = None):
        self.directory = directory or run_dir()

    def cancel(self, key: str) -> None:
        (self.directory / f"{key}.cancel").touch()

    def is_cancelled(self, key: str | None) -> bool:
        return key is not None and (self.directory / f"{key}.cancel").exists()

    def forget(self, key: str) -> None:
        (self.directory / f"{key}.cancel").unlink(missing_ok=True)


class StageErrors:
    """Errors a stage could not send through BLS, one file per key (the error's message, its
    status tag in it, which ``triton_omni_protocol.parse_status`` reads)."""

    def __init__(self, directory: Path | None = None):
        self.directory = directory or run_dir()

    def record(self, key: str, message: str) -> None:
        path = self.directory / f"{key}.error"
        partial = path.with_suffix(".partial")
        partial.write_text(message)
        partial.replace(path)  # whole or absent for a reader

    def take(self, key: str) -> str | None:
        """The error recorded for ``key`` (removed), or None."""
        path = self.directory / f"{key}.error"
        try:
            message = path.read_text()
        except FileNotFoundError:
            return None
        path.unlink(missing_ok=True)
        return message


class ProgressSender:
    """Stage side: one non-blocking datagram socket for every request."""

    def __init__(self, directory: Path | None = None):
        self.directory = directory or run_dir()
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)

    def send(self, listener: str | None, key: str | None, step: int, total: int) -> None:
        if listener is None or key is None:
            return
        try:
            self._socket.sendto(f"{key} {step} {total}".encode(), str(self.directory / f"{listener}.sock"))
        except OSError as exc:  # listener gone or its buffer full: progress is advisory
            logger.debug("progress %s %d/%d not delivered: %s", key, step, total, exc)

    def close(self) -> None:
        self._socket.close()


class ProgressListener:
    """Scheduler side: routes progress datagrams to the callback of their key."""

    def __init__(self, directory: Path | None = None):
        self.name = new_id()
        self.path = (directory or run_dir()) / f"{self.name}.sock"
        self._callbacks: dict[str, Callable[[int, int], None]] = {}
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> ProgressListener:
        loop = asyncio.get_running_loop()
        listener = self

        class Protocol(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr) -> None:
                listener._route(data)

        self._transport, _ = await loop.create_datagram_endpoint(Protocol, local_addr=str(self.path),
                                                                 family=socket.AF_UNIX)
        return self

    def subscribe(self, key: str, callback: Callable[[int, int], None]) -> None:
        self._callbacks[key] = callback

    def unsubscribe(self, key: str) -> None:
        self._callbacks.pop(key, None)

    def _route(self, data: bytes) -> None:
        try:
            key, step, total = data.decode().split()
            callback = self._callbacks.get(key)
            if callback is not None:
                callback(int(step), int(total))
        except ValueError:
            logger.warning("malformed progress datagram %r", data[:80])

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self.path.unlink(missing_ok=True)


def _create(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)


class ReplyWriter:
    """Scheduler side: a reply's token ids, a line at a time as the thinker writes them (and, with
    ``states``, the thinker's states beside them)."""

    def __init__(self, directory: Path | None = None, states: bool = False):
        self.name = new_id()
        self.path = (directory or run_dir()) / f"{self.name}.reply"
        self.states_path = self.path.with_suffix(".states")
        self._fd: int | None = _create(self.path)
        try:
            self._states_fd: int | None = _create(self.states_path) if states else None
        except OSError:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise

    def add(self, token_ids: list[int], states: np.ndarray | None = None) -> None:
        """``states``: float32 rows of the thinker's width, written ahead of the ids they came with."""
        if states is not None and len(states) and self._states_fd is not None:
            os.write(self._states_fd, np.ascontiguousarray(states, dtype=np.float32).tobytes())
        if token_ids:
            self._write(" ".join(map(str, token_ids)))

    def end(self, complete: bool = True) -> None:
        """The reply is whole (``complete``), or will never be (the thinker failed or was cancelled)."""
        if self._fd is not None:
            self._write("end" if complete else "abort")
            os.close(self._fd)
            self._fd = None
        if self._states_fd is not None:
            os.close(self._states_fd)
            self._states_fd = None

    def remove(self) -> None:
        self.end(complete=False)
        self.path.unlink(missing_ok=True)
        self.states_path.unlink(missing_ok=True)

    def _write(self, line: str) -> None:
        os.write(self._fd, f"{line}\n".encode())  # one write: O_APPEND keeps lines whole and in order


class ReplyReader:
    """Stage side: what a ``ReplyWriter`` has written so far (its lines read whole; with
    ``states_width``, its states too, in whole rows)."""

    def __init__(self, name: str, directory: Path | None = None, states_width: int | None = None):
        path = (directory or run_dir()) / f"{name}.reply"
        self._fd = os.open(path, os.O_RDONLY)  # FileNotFoundError: no such reply
        try:  # FileNotFoundError: a reply written without the states this reader needs
            self._states_fd = os.open(path.with_suffix(".states"), os.O_RDONLY) if states_width else None
        except OSError:
            os.close(self._fd)
            raise
        self._row_bytes = 4 * (states_width or 0)
        self._partial = b""
        self._partial_states = b""
        self.state: str | None = None  # "end" or "abort" once written

    def read(self) -> list[int]:
        """The token ids written since the last call."""
        ids: list[int] = []
        while self.state is None and (data := os.read(self._fd, 65536)):
            *lines, self._partial = (self._partial + data).split(b"\n")
            for line in lines:
                if line in (b"end", b"abort"):
                    self.state = line.decode()
                    break
                ids += [int(token) for token in line.split()]
        return ids

    def read_states(self) -> np.ndarray:
        """The states written since the last call, float32 [rows, width] (whole rows only)."""
        data = self._partial_states
        while self._states_fd is not None and (more := os.read(self._states_fd, 1 << 20)):
            data += more
        whole = len(data) - len(data) % self._row_bytes if self._row_bytes else 0
        self._partial_states = data[whole:]
        # a copy: frombuffer's array is read-only, which torch warns of when it takes it
        return np.frombuffer(data[:whole], dtype=np.float32).reshape(-1, self._row_bytes // 4 or 1).copy()

    def close(self) -> None:
        os.close(self._fd)
        if self._states_fd is not None:
            os.close(self._states_fd)
