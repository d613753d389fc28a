"""Join the shortest queue: spreading requests over a model's instances
when ``execute`` returns at once.

Why: under step batching ``execute`` hands its requests to the engine and
returns, so every instance looks idle to Triton, which gives the next batch
to whichever instance thread asks first. Measured with two CPU instances of
``diffusion``: a burst of 8 requests went 7 to one instance and 1 to the
other (with Triton's dynamic batcher, as one batch of 7 and one of 1). Two
GPUs serving that way run one nearly empty while the other queues.

How: each instance publishes its load (requests in its engine) in a small
file, one per instance, in a folder under ``/dev/shm`` that the model's
instances on this server share (``/dev/shm/triton-omni-load-<server>/<model>``;
a record names its instance's process by pid and start time, so that a
record left by a killed stub is never taken for a live sibling that reused
its pid). After handing its requests over, an
instance that carries more than the least loaded live sibling keeps
``execute`` until that is no longer so, so that Triton gives the next
requests to a sibling: loads then differ by at most one (``slack``). With
two CPU instances and the same bursts of 8 as above: 4/4, three times. The
least loaded instance never waits, so some instance always takes work, and
a wait is bounded (``max_hold_s``) in case a sibling hangs. No siblings, no
wait. A model with one instance (its config says so: ``instance_count``)
skips all of it: no record written per request, no listing per
``execute``. Each of those is a system call that lets the stub's other
threads take the GIL, and ``execute`` then waits to get it back; Triton
hands an instance its next request only when ``execute`` returns.

A full instance (its engine would queue the next request: ``full``) keeps
``execute`` too, even when it is the least loaded, until a request of its
own finishes: the next request then waits in Triton's queue, where
whichever instance frees a place first takes it, rather than in one engine
behind a whole image while a sibling has room. Why: the choice above is
made when ``execute`` returns, and an idle instance thread cannot take it
back. Without it a full engine now and then took one more request just
before a sibling finished one, and that request waited a whole image.
That hold ends at the latest after ``max_full_hold_s`` (the model parameter
``full_hold_s``, 30 s by default): an engine that hangs must not keep its
instance's ``execute``, and with it the model's unload, for ever. Past it a
full instance takes requests again, which then wait in its engine: a model
whose requests take longer than that (a video) wants it longer.

The load is a request count: requests of one model cost alike to first
order (same sizes and steps under a bench; a mix evens out over many).
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from triton_omni.processes import alive, server_folder, start_ticks
from triton_omni.triton.params import model_parameters

_RECORD = struct.Struct("<qqq")  # (pid, start ticks, load)
DEFAULT_FULL_HOLD_S = 30.0


class InstanceLoads:
    def __init__(self, model: str, instance: str, server_pid: int | None = None, root: Path = Path("/dev/shm"),
                 slack: int = 0, max_hold_s: float = 2.0, max_full_hold_s: float = DEFAULT_FULL_HOLD_S,
                 poll_s: float = 0.005,
                 instances: int | None = None):
        """``instance``: this instance's name (unique among the model's);
        ``server_pid``: the tritonserver the instances share (the stub's parent);
        ``instances``: how many the model has (``instance_count``); 1: this
        one alone, which never holds; None: not known, look for siblings."""
        self.folder = server_folder(root, "triton-omni-load", server_pid) / model
        self.folder.mkdir(parents=True, exist_ok=True)
        self._started = start_ticks(os.getpid())
        # Triton names a group's instances alike on every GPU (diffusion_0_0 on GPU 0 and on GPU 1)
        self.name = f"{instance}.{os.getpid()}"
        self.slack, self.max_hold_s, self.max_full_hold_s, self.poll_s = slack, max_hold_s, max_full_hold_s, poll_s
        self._fd = os.open(self.folder / self.name, os.O_RDWR | os.O_CREAT, 0o600)
        self.alone = instances == 1
        self._load = 0
        self._changed = threading.Condition()
        self._publish()

    @classmethod
    def of_instance(cls, args: dict, model_config: dict) -> InstanceLoads:
        """This stub's instance, from what Triton hands ``initialize``: its
        ``args`` and the model's config, which says how many instances there are and, in
        ``full_hold_s``, how long a full instance may keep ``execute``."""
        return cls(args["model_name"], args["model_instance_name"], instances=instance_count(model_config),
                   max_full_hold_s=full_hold_s(model_parameters(model_config)))

    @property
    def load(self) -> int:
        return self._load

    def add(self, n: int) -> None:
        """This instance took (n > 0) or finished (n < 0) requests."""
        with self._changed:
            self._load += n
            if not self.alone:  # nobody reads it
                self._publish()
            self._changed.notify_all()

    def siblings(self) -> list[int]:
        """The loads of the model's other live instances (a dead one's file is removed)."""
        loads = []
        for entry in os.scandir(self.folder):
            if entry.name == self.name:
                continue
            record = _read(entry.path)
            if record is None:
                continue
            pid, started, load = record
            if alive(pid, started):
                loads.append(load)
            else:  # a killed stub leaves its file; a restarted instance writes a new pid
                _unlink(entry.path)
        return loads

    def hold(self, full: Callable[[], bool] = lambda: False) -> float:
        """Waits while this instance carries more than its least loaded sibling
        (plus ``slack``), at most ``max_hold_s``; and, if it has siblings, while
        it is ``full`` (a request taken now would wait in its engine), at most
        ``max_full_hold_s``. Returns the seconds waited."""
        if self.alone:
            return 0.0
        start = time.monotonic()
        while True:
            others = self.siblings()
            if not others:
                return 0.0
            waited = time.monotonic() - start
            is_full = full()
            if is_full:
                if waited >= self.max_full_hold_s:
                    return waited
            elif self._load <= min(others) + self.slack or waited >= self.max_hold_s:
                return waited
            # woken when this instance finishes a request; siblings are polled, and need not be while
            # full: only a request of its own ends that
            with self._changed:
                self._changed.wait(self.poll_s * 10 if is_full else self.poll_s)

    def close(self) -> None:
        os.close(self._fd)
        _unlink(self.folder / self.name)
        with contextlib.suppress(OSError):  # the last instance out removes the folder (and the server's)
            self.folder.rmdir()
            self.folder.parent.rmdir()

    def _publish(self) -> None:
        os.pwrite(self._fd, _RECORD.pack(os.getpid(), self._started, self._load), 0)


def full_hold_s(params: dict[str, str]) -> float:
    """The model parameter ``full_hold_s``: seconds, above 0 (a bad value fails the load)."""
    raw = params.get("full_hold_s", "").strip()
    if not raw:
        return DEFAULT_FULL_HOLD_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"model parameter 'full_hold_s' must be a number of seconds above 0, got {raw!r}")
    return value


def instance_count(model_config: dict) -> int | None:
    """How many instances Triton makes of a model on this server, from the
    config it gives the stub; None where that is not said (a ``KIND_GPU``
    group without its GPUs listed: Triton puts ``count`` on every GPU)."""
    groups = model_config.get("instance_group") or []
    total = 0
    for group in groups:
        count = int(group.get("count", 1))
        if group.get("kind", "KIND_GPU") == "KIND_GPU":
            if not group.get("gpus"):
                return None
            count *= len(group["gpus"])
        total += count
    return total or None


def _read(path: str) -> tuple[int, int, int] | None:
    try:
        with open(path, "rb") as file:
            data = file.read(_RECORD.size)
    except OSError:  # removed meanwhile
        return None
    return _RECORD.unpack(data) if len(data) == _RECORD.size else None


def _unlink(path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)

