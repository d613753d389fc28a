"""Bring back a model whose Python backend stub died.

Triton 2.51 never notices a dead stub: the model stays READY, `/v2/health/ready`
says 200, and every request to it (and to the ensembles and the `omni` routes
that use it) fails with INTERNAL "Stub process ... is not healthy" until
someone restarts the server. The supervisor, a thread of the launcher,
watches the stubs from outside:

- every ``interval_s`` it lists the server's stub processes (``/proc``: the
  stub's command line names its model and instance);
- a model Triton reports READY whose stub is gone, a zombie, or stopped
  by SIGSTOP is dead. So is one that lost a stub while others of its
  instances live on: a stub seen last round is gone, and its shared-memory
  region is still there (a stub that exits cleanly takes it with it). A stub a debugger or a profiler holds (``py-spy``
  stops it for every sample) is not: an operator looking at a stub must
  not get it killed. The supervisor logs it and unloads it
  through the model-repository API (the launcher's admin key): readiness
  then says so at once (`/v2/health/ready` and the model's ready endpoint
  answer 400, which Kubernetes probes read as not ready), and new requests
  fail fast with "unknown model" instead of waiting on a dead stub;
- then it loads the model again; the ensembles that use it come back with it,
  and the other models are never touched. A load that fails is retried after
  ``backoff_s``, doubling, at most ``max_attempts`` times in a row;
- each restart adds one to ``<run dir>/restarts/<model>``, which the model
  reports as ``omni_stage_restarts_total{model}`` when it loads
  (``triton_omni.triton.metrics.report_restarts``).

A model unloaded on purpose (its state is not READY) is left alone. A stub
that is alive but stuck (a deadlock) is not detected here: Triton's own
health check ends it after its stub timeout, and the supervisor then sees
it gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from triton_omni.channel import restarts_file

logger = logging.getLogger(__name__)

STUB_BINARY = "triton_python_backend_stub"


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str
    instance: str
    state: str  # /proc/<pid>/stat: R, S, D (alive), Z (zombie), T (stopped), t (held by a tracer)
    region: str  # its shared-memory region in /dev/shm, which nobody removes when the stub is killed
    cpu_s: float = 0.0  # CPU seconds it has used, all threads (utime + stime)

    @property
    def alive(self) -> bool:
        # "t" is a tracing stop: py-spy or gdb looking at the stub, which goes on when they let go.
        return self.state not in ("Z", "T", "X")


def _after_comm(stat: str) -> list[str]:
    """The fields of a ``/proc/<pid>/stat`` line, "pid (comm) state ppid ...", from the state on;
    comm may hold spaces and parentheses, so they are read after its last ')'."""
    return stat[stat.rindex(")") + 2 :].split()


def stat_fields(stat: str) -> tuple[str, int]:
    """(state, parent pid) from a ``/proc/<pid>/stat`` line."""
    state, ppid = _after_comm(stat)[:2]
    return state, int(ppid)


def server_stubs(server_pid: int) -> list[Stub]:
    """The Python backend stubs the server started: their model (from the
    ``<repository>/<model>/<version>/model.py`` argument) and instance name."""
    stubs = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        if not args[0].endswith(STUB_BINARY.encode()) or len(args) < 9:
            continue
        state, ppid = stat_fields(stat)
        if ppid != server_pid:
            continue
        model = Path(args[1].decode()).parent.parent.name
        utime, stime = _after_comm(stat)[11:13]
        cpu_s = (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
        stubs.append(Stub(int(entry.name), model, args[8].decode(), state, args[2].decode(), cpu_s))
    return stubs


def stub_cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds each model's stubs have used so far, by model."""
    totals: dict[str, float] = {}
    for stub in server_stubs(server_pid):
        totals[stub.model] = totals.get(stub.model, 0.0) + stub.cpu_s
    return totals


def remove_regions(stubs: list[Stub]) -> None:
    """The shared memory of stubs that are gone (Triton removes a region only when its stub exits cleanly)."""
    for stub in stubs:
        with contextlib.suppress(OSError):
            Path("/dev/shm", stub.region).unlink()


class RepositoryApi:
    """Triton's model-repository API over HTTP, with the launcher's admin key."""

    def __init__(self, http_url: str, header: str, key: str):
        self.base, self.headers = f"http://{http_url}", {header: key}

    def ready_models(self) -> set[str]:
        return {entry["name"] for entry in json.loads(self._post("/v2/repository/index"))
                if entry.get("state") == "READY"}

    def unload(self, model: str) -> None:
        self._post(f"/v2/repository/models/{model}/unload")

    def load(self, model: str) -> None:
        self._post(f"/v2/repository/models/{model}/load", timeout_s=600)

    def _post(self, path: str, timeout_s: float = 30) -> bytes:
        request = urllib.request.Request(self.base + path, data=b"{}", method="POST", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path}: HTTP {exc.code} {exc.read().decode(errors='replace')}") from None


class Supervisor:
    def __init__(self, server_pid: int, api: RepositoryApi, run_dir: Path, interval_s: float = 1.0,
                 backoff_s: float = 2.0, max_attempts: int = 5):
        self.server_pid, self.api, self.run_dir = server_pid, api, run_dir
        self.interval_s, self.backoff_s, self.max_attempts = interval_s, backoff_s, max_attempts
        self.restarts: dict[str, int] = {}
        self.python_models: set[str] = set()  # the models whose stubs were seen
        self._last_seen: dict[int, Stub] = {}  # pid -> stub, as of the last round
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="omni-supervisor", daemon=True)

    def start(self) -> Supervisor:
        """Call once the server is ready: every loaded model's stubs are seen now, so that a stub
        that dies before the first round is still known as one (a stub killed a second after
        startup used to go unnoticed: its model stayed READY and failed every request)."""
        stubs = server_stubs(self.server_pid)
        self.python_models |= {stub.model for stub in stubs}
        self._last_seen = {stub.pid: stub for stub in stubs}
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # the server stopping, a slow answer: try again next round
                logger.debug("supervisor round failed", exc_info=True)

    def check(self) -> list[str]:
        """One round: the models found dead, each restarted."""
        stubs = server_stubs(self.server_pid)
        self.python_models |= {stub.model for stub in stubs}  # ensembles have no stub
        alive = {stub.model for stub in stubs if stub.alive}
        dead = {stub.model for stub in stubs if not stub.alive}
        ready = self.api.ready_models() & self.python_models
        dead |= {model for model in ready if model not in alive}
        vanished = self._vanished(stubs)
        dead |= {stub.model for stub in vanished if stub.model in ready}
        found = sorted(dead)
        for model in found:
            if self._stop.is_set():
                break
            self.restart(model, [stub for stub in stubs if stub.model == model],
                         gone=[stub for stub in vanished if stub.model == model])
        return found

    def _vanished(self, stubs: list[Stub]) -> list[Stub]:
        """Stubs seen last round that are gone now and left their shared memory
        behind: killed, where a sibling instance of their model lives on (a model
        with several instances, or several instances sharing one vLLM engine)."""
        current = {stub.pid: stub for stub in stubs}
        gone = [stub for pid, stub in self._last_seen.items() if pid not in current]
        self._last_seen = current
        return [stub for stub in gone if Path("/dev/shm", stub.region).exists()]

    def restart(self, model: str, stubs: list[Stub], gone: list[Stub] = ()) -> None:
        """``stubs``: the model's stub processes now; ``gone``: those that vanished (their regions only)."""
        started = time.monotonic()
        logger.error("model '%s': its stub is %s; unloading it (readiness false) and loading it again", model,
                     ", ".join([f"{s.instance} pid {s.pid} state {s.state}" for s in stubs]
                               + [f"{s.instance} pid {s.pid} gone" for s in gone]) or "gone")
        for stub in stubs:  # a stopped stub never exits by itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(stub.pid, signal.SIGKILL)
        self.api.unload(model)
        self._count(model)
        for attempt in range(1, self.max_attempts + 1):
            try:
                self.api.load(model)
            except Exception as exc:
                wait = self.backoff_s * 2 ** (attempt - 1)
                logger.error("model '%s': load attempt %d of %d failed (%s); next in %.0f s", model, attempt,
                             self.max_attempts, exc, wait)
                if self._stop.wait(wait):
                    return
                continue
            logger.warning("model '%s' is serving again, %.1f s after its stub was found dead", model,
                           time.monotonic() - started)
            remove_regions([*stubs, *gone])
            return
        logger.error("model '%s': giving up after %d load attempts; it stays unloaded", model, self.max_attempts)

    def _count(self, model: str) -> None:
        self.restarts[model] = self.restarts.get(model, 0) + 1
        path = restarts_file(self.run_dir, model)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(self.restarts[model]))
