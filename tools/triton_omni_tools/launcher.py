"""Launch a real ``tritonserver`` with this project's model repositories.

One launcher for every use (``omni-triton serve``, the tests, the benchmarks).
It finds a server (the NGC image's ``/opt/tritonserver``, or the one bundled in
the ``nvidia-pytriton`` wheel), assembles a backend directory holding the
server's backends plus this project's Python-based backends, sets the
environment the Python backend stub needs, starts the server in its own
process group, waits until it is ready, and on stop takes the whole group
down (server, stubs and engine processes) so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from triton_omni.demo_models import built_once
from triton_omni.processes import identity
from triton_omni_protocol import ADMIN_HEADER

from triton_omni_tools import memory_plan, placement
from triton_omni_tools.demos import demo_edits, demo_repositories
from triton_omni_tools.gateway import API_KEY_ENV, Gateway, text_model_tokenizers
from triton_omni_tools.reaper import Leftovers, Reaper, mapped_shared_memory, process_group, reap
from triton_omni_tools.restarts import RestartPolicy, describe_exit, died_abnormally
from triton_omni_tools.supervisor import RepositoryApi, Supervisor, server_stubs

logger = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROJECT_BACKENDS = PROJECT_ROOT / "backends"
DEFAULT_REPOSITORIES = [PROJECT_ROOT / "model_repository", PROJECT_ROOT / "ensemble"]
SYSTEM_SERVER = Path("/opt/tritonserver")

ServerChoice = Literal["auto", "embedded", "system"]


# Stopping: Triton stops taking requests and gives those in flight this long to finish
# (--exit-timeout-secs, ServerOptions.exit_timeout_s), then unloads the models; whatever is
# left UNLOAD_S after that is killed. A container's grace period must cover both
# (deploy/kubernetes.yaml; a DiT pool that drains longer, deploy/pools).
EXIT_TIMEOUT_S = 15


@dataclass
class ServerOptions:
    model_repositories: list[Path] = field(default_factory=lambda: list(DEFAULT_REPOSITORIES))
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_verbose: int = 0
    model_control_mode: str = "none"  # none | explicit | poll
    load_models: list[str] = field(default_factory=list)
    server: ServerChoice = "auto"
    startup_timeout_s: float = 600.0
    # With a log file: a start whose log stays silent this long while models load is taken as hung
    # (start(): each stub's stacks into the log, then another start); None: never.
    startup_stall_s: float | None = 900.0
    log_file: Path | None = None  # server output goes here instead of the console
    extra_args: list[str] = field(default_factory=list)
    # Loopback unless told otherwise (the Docker image binds 0.0.0.0).
    bind: str = "127.0.0.1"
    # The admin APIs answer only requests carrying this key in the ADMIN_HEADER header;
    # None: $TRITON_OMNI_ADMIN_KEY, else a random key nobody knows (the APIs are closed).
    admin_key: str | None = None
    # Watch the Python backend stubs and bring back a model whose stub died (supervisor.py).
    # Needs model control: with mode "none" the server runs in "explicit" mode, every model loaded.
    supervise: bool = False
    # Which GPUs each stage uses, ``STAGE=GPUS[xN]`` or ``STAGE=tp:GPUS`` (placement.py): the
    # server then loads a copy of the repositories with those instance groups.
    placement: list[str] = field(default_factory=list)
    # How long requests in flight may take to finish once the server is told to stop.
    exit_timeout_s: int = EXIT_TIMEOUT_S
    # Stages served by another Triton server, ``MODEL=HOST:PORT`` (remote.py): forwarded by name.
    remote: list[str] = field(default_factory=list)
    # The demo models' family (demos.py): "sd", "qwen-image" or "z-image".
    demo: str = "sd"
    # `serve` also runs the OpenAI-compatible gateway on this port (gateway.py); 0: no gateway.
    openai_port: int = 0
    # The key its clients must send (Authorization: Bearer); None: $TRITON_OMNI_API_KEY, else no key.
    api_key: str | None = None
    openai_workers: int = 1  # the gateway's processes


@dataclass(frozen=True)
class ServerInstall:
    """Where a tritonserver's binary, backends and shared libraries live."""

    binary: Path
    backends: Path
    lib_dirs: tuple[Path, ...] = ()
    stubs: Path | None = None  # per-Python-version stubs (the pip bundle only)


# Triton's APIs that change or expose the server beyond inference: restricted by default.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
# How long Triton waits for a new stub process to answer (its default is 30 s). On a busy host
# (another server loading beside it, two cores) a stub's start took longer, and the model failed to load.
STUB_TIMEOUT_S = 120
UNLOAD_S = 15.0
STOP_TIMEOUT_S = EXIT_TIMEOUT_S + UNLOAD_S
# A start whose tritonserver crashes (these signals) or hangs before it is ready is tried again, this many
# times in all.
STARTUP_ATTEMPTS = 3
# What a stub of this project does on this signal: every thread's stack to its stderr, the server's log
# (triton_omni.triton, through faulthandler), without stopping.
STACKS_SIGNAL = signal.SIGUSR1
STARTUP_CRASHES = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)


_PORTS_GIVEN: set[int] = set()  # by free_port, in this process: never twice


def free_port() -> int:
    """A TCP port free right now on localhost (for servers started beside
    others), chosen below the kernel's ephemeral range.

    Why below: tritonserver binds its ports only after its models have
    loaded, and meanwhile every socket bound to port 0 (vLLM's engine core
    and workers open several) gets a port from that range. A test server
    once failed to start so ("Socket '127.0.0.1:40411' already in use")
    when its HTTP port had come from the same range."""
    import random
    import socket

    low = _ephemeral_ports()[0]
    below = range(max(1024, low - 12_000), low)
    for port in random.sample(below, k=min(200, len(below))):
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    with socket.socket() as sock:  # nothing free below the range: any port the kernel gives
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for port-0 binds and outgoing connections (Linux's default if unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def find_server(choice: ServerChoice = "auto") -> ServerInstall:
    if choice in ("auto", "system") and (SYSTEM_SERVER / "bin" / "tritonserver").exists():
        return ServerInstall(SYSTEM_SERVER / "bin" / "tritonserver", SYSTEM_SERVER / "backends")
    if choice in ("auto", "system") and (which := shutil.which("tritonserver")):
        root = Path(which).resolve().parents[1]
        return ServerInstall(Path(which), root / "backends")
    if choice == "system":
        raise FileNotFoundError("no system tritonserver (looked in /opt/tritonserver and on PATH)")
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no tritonserver: install nvidia-pytriton (make install) or use the NGC image")
    package = Path(spec.submodule_search_locations[0])
    root = package / "tritonserver"
    return ServerInstall(
        binary=root / "bin" / "tritonserver",
        backends=root / "backends",
        lib_dirs=(package.parent / "nvidia_pytriton.libs", libpython_dir()),
        stubs=root / "python_backend_stubs",
    )


def libpython_dir() -> Path:
    """A folder holding only this interpreter's shared libpython, which the
    bundle's stub links against, for ``LD_LIBRARY_PATH``.

    Not the interpreter's whole ``LIBDIR``: on a distribution Python that is
    ``/usr/lib/x86_64-linux-gnu``, where a system cuDNN may live. cuDNN loads
    its engine libraries by name, so through ``LD_LIBRARY_PATH`` the stub's
    torch got the system's engines beside its own ``libcudnn.so.9``, and
    convolutions ran slower in Triton than in a plain process.
    """
    libdir = Path(sysconfig.get_config_var("LIBDIR"))
    names = {sysconfig.get_config_var(k) for k in ("INSTSONAME", "LDLIBRARY")} - {None}
    found = [libdir / name for name in names if ".so" in name and (libdir / name).exists()]
    if not found:
        return libdir  # no shared libpython to isolate: fall back to the whole folder
    key = hashlib.sha1(str(libdir).encode()).hexdigest()[:10]
    dest = PROJECT_ROOT / ".cache" / "libpython" / key
    dest.mkdir(parents=True, exist_ok=True)
    for library in found:
        with contextlib.suppress(FileExistsError):  # already there, or made by a concurrent launch
            (dest / library.name).symlink_to(library)
    return dest


def build_backend_dir(install: ServerInstall) -> Path:
    """A backend directory: the server's backends, the Python backend with the
    stub for *this* interpreter, and each ``backends/<name>/model.py`` here.

    The Python backend's files are copied (Triton refuses a backend library
    whose real path lies outside the backend directory); the rest are
    symlinks, so edits to a model.py take effect on the next load. Built once
    per server install, interpreter and set of backends: servers started side
    by side share it, and a start never removes it from under a running
    server (whose stubs start from it).
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    models = sorted(model_py.parent.name for model_py in PROJECT_BACKENDS.glob("*/model.py"))
    copied = sorted((item.name, item.stat().st_size, item.stat().st_mtime_ns)
                    for item in (install.backends / "python").iterdir() if item.is_file())
    made_of = f"{install.backends}|{install.stubs}|{version}|{models}|{copied}"
    key = hashlib.sha1(made_of.encode()).hexdigest()[:10]

    def fill(dest: Path) -> None:
        for backend in install.backends.iterdir():
            if backend.name != "python":
                (dest / backend.name).symlink_to(backend)
        python = dest / "python"
        python.mkdir()
        for item in (install.backends / "python").iterdir():
            if item.is_file():
                shutil.copy2(item, python / item.name)
        if install.stubs is not None:
            stub = install.stubs / version / "triton_python_backend_stub"
            if not stub.exists():
                raise FileNotFoundError(f"the bundled server has no Python backend stub for Python {version}")
            (python / "triton_python_backend_stub").symlink_to(stub)
        for name in models:
            (dest / name).mkdir()
            (dest / name / "model.py").symlink_to(PROJECT_BACKENDS / name / "model.py")

    return built_once(PROJECT_ROOT / ".cache" / "backends" / key, fill, made_of)  # stamped with what it is made of


@functools.cache
def gpu_count() -> int:
    """GPUs nvidia-smi sees (0 without one); no CUDA context is created. Asked once per process."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True,
                             env=os.environ.copy()).stdout  # a private copy: see reaper.Reaper
    except (subprocess.SubprocessError, OSError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def server_env(install: ServerInstall) -> dict[str, str]:
    env = dict(os.environ)
    # The stub takes its sys.path from the first python3 on PATH (PYTHONPATH
    # is ignored), so this interpreter's bin/ goes first.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    lib_path = [str(d) for d in install.lib_dirs if d.exists()]
    if env.get("LD_LIBRARY_PATH"):
        lib_path.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_path)
    # vLLM on CPU: no pinning of every engine to the same cores (several engines
    # share this machine with the server). Its KV cache is sized per model
    # (engine_vllm.cpu_kv_cache_bytes) unless VLLM_CPU_KVCACHE_SPACE is set.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key, value in vllm_gpu_env().items():
        env.setdefault(key, value)
    return env


def vllm_gpu_env() -> dict[str, str]:
    """What vLLM needs on a GPU host, for the server's stubs and for any
    process that drives vLLM itself (the bench's direct side, tests/gpu).

    Its engine core is spawned, never forked from a process that already ran
    torch (a forked core hung in its first tensor operation); and without
    FlashInfer installed, vLLM's own sampler instead of FlashInfer's."""
    if not gpu_count():
        return {}
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if importlib.util.find_spec("flashinfer") is None:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


def startup_report(log: str) -> str:
    """The models that failed to load (with Triton's reason) and those still loading, from a server's log."""
    failed = re.findall(r"\"failed to load '([^']+)' version \d+: ([^\n]*)\"", log)
    loading = still_loading(log)
    lines = [f"failed to load {name}: {reason}" for name, reason in failed]
    if loading:
        lines.append(f"still loading: {', '.join(loading)}")
    return "\n".join(lines or ["no model failed or was still loading"])


def still_loading(log: str) -> list[str]:
    """The models a server's log says it began loading and never loaded nor failed to."""
    failed = re.findall(r"\"failed to load '([^']+)' version \d+:", log)
    ended = {*re.findall(r"\"successfully loaded '([^']+)'", log), *failed}
    return [name for name in dict.fromkeys(re.findall(r'"loading: ([^:"]+):\d+"', log)) if name not in ended]


# A load whose stubs use less CPU than this (cores, on average) while its log is silent makes no progress:
# a deadlocked stub uses almost none, a silent compile or build at least one core.
BUSY_CORES = 0.05


class _Silence:
    """How long a load has made no progress: its log has not grown and ``cpu_seconds()`` (the CPU time
    of the stubs still loading) has risen by less than ``BUSY_CORES``; ``too_long`` past ``limit_s``
    (never without a file or a limit)."""

    def __init__(self, log_file: Path | None, limit_s: float | None, cpu_seconds: Callable[[], float]):
        self.log_file, self.limit_s, self.cpu_seconds = log_file, limit_s, cpu_seconds
        self._size, self._cpu = -1, 0.0
        self._since = self._checked = time.monotonic()

    def too_long(self) -> bool:
        if self.log_file is None or self.limit_s is None:
            return False
        now = time.monotonic()
        size = self.log_file.stat().st_size if self.log_file.exists() else 0
        cpu = self.cpu_seconds() if size == self._size else self._cpu
        if size != self._size or cpu - self._cpu >= BUSY_CORES * (now - self._checked):
            self._since = now
        self._size, self._cpu, self._checked = size, cpu, now
        return now - self._since > self.limit_s


class TritonServer:
    """A running tritonserver; use as a context manager or call start/stop."""

    def __init__(self, options: ServerOptions):
        self.options = options
        self.process: subprocess.Popen | None = None
        self.supervisor: Supervisor | None = None
        self._log = None
        self._log_start = 0  # where this start attempt's lines begin in the log
        self._segments: set[Path] = set()  # /dev/shm files its processes map (mapped_shared_memory)
        self.reaper: Reaper | None = None
        self._identity = ""  # the server process's (processes.identity), which names its stubs' folders
        self.startup_retries = 0  # starts that crashed before the server was ready (start())
        # This server's own folder: progress sockets, restart counts (TRITON_OMNI_RUN_DIR in its stubs)
        self.run_dir = Path(tempfile.mkdtemp(prefix="triton-omni-run-"))
        # Removed by stop(); for a server never started, once this object is collected or at exit.
        self._remove_run_dir = weakref.finalize(self, shutil.rmtree, self.run_dir, ignore_errors=True)
        self.admin_key = options.admin_key or os.environ.get("TRITON_OMNI_ADMIN_KEY") or secrets.token_hex(16)
        # What the server loads: the options' repositories, or their copies with the placement applied.
        try:
            from triton_omni_tools.remote import remote_edits
            from triton_omni_tools.repository import merge_edits

            repositories = options.model_repositories + demo_repositories(options.demo)
            edits = merge_edits(demo_edits(options.demo), remote_edits(options.remote, repositories))
            self.repositories = placement.place_repositories(repositories, options.placement, gpu_count(),
                                                             self.run_dir / "repositories", edits)
        except Exception:
            self._remove_run_dir()
            raise

    @property
    def http_url(self) -> str:
        return f"localhost:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.options.metrics_port}/metrics"

    @property
    def shm_prefix(self) -> str:
        """This server's names for the Python backend's shared memory in /dev/shm. Two servers on
        one machine with Triton's default names crash or hang (Triton's python_backend README);
        here a bench server started beside the test suite's aborted during startup."""
        return "triton_omni_" + self.run_dir.name.removeprefix("triton-omni-run-") + "_"

    @property
    def control(self) -> tuple[str, list[str]]:
        """(model control mode, models loaded at start): the supervisor reloads models through the
        repository API, so it turns mode "none" into "explicit" with every model loaded."""
        opts = self.options
        if opts.supervise and opts.model_control_mode == "none":
            return "explicit", ["*"]
        return opts.model_control_mode, opts.load_models

    def command(self, install: ServerInstall, backend_dir: Path) -> list[str]:
        opts = self.options
        mode, load_models = self.control
        cmd = [str(install.binary)]
        cmd += [f"--model-repository={repo}" for repo in self.repositories]
        cmd += [
            f"--backend-directory={backend_dir}",
            f"--http-port={opts.http_port}",
            f"--grpc-port={opts.grpc_port}",
            f"--metrics-port={opts.metrics_port}",
            f"--log-verbose={opts.log_verbose}",
            f"--model-control-mode={mode}",
            f"--exit-timeout-secs={opts.exit_timeout_s}",
            f"--http-address={opts.bind}",
            f"--grpc-address={opts.bind}",
            f"--metrics-address={opts.bind}",
            f"--http-restricted-api={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--backend-config=python,stub-timeout-seconds={STUB_TIMEOUT_S}",
        ]
        cmd += [f"--load-model={name}" for name in load_models]
        return cmd + opts.extra_args

    def memory_shares(self) -> list[memory_plan.Share]:
        """The GPU shares of the models this server loads (none without a GPU)."""
        gpus = gpu_count()
        if gpus == 0:
            return []
        mode, load_models = self.control
        return memory_plan.plan(self.repositories,
                                load_models if mode == "explicit" and "*" not in load_models else None, gpus)

    def check_memory_plan(self) -> None:
        """Refuse to start when the models' GPU shares do not fit (memory_plan.py)."""
        shares = self.memory_shares()
        memory_plan.check(shares)
        if shares:
            logger.info("%s", memory_plan.describe(shares))

    def start(self) -> TritonServer:
        """Start tritonserver and wait until it is ready; a server that crashes while starting
        (``STARTUP_CRASHES``), or whose load hangs (its log silent for ``startup_stall_s``), is
        started again, at most ``STARTUP_ATTEMPTS`` times in all.

        Why: Triton 2.51 now and then aborts while loading Python-backend models
        (``boost::interprocess::lock_exception``, an intermittent failure in
        Triton's own tracker), and nothing else would retry a start. A load once
        stopped for good with every stub's runner built (one model of fifteen never
        reported loaded, its log silent for 17 minutes): a hung start has each stub
        of the models still loading write its threads' stacks into the log first, so
        that the log says where it stopped. A start
        that fails for a reason that will not change is not retried: a memory
        plan that does not fit (refused before launching), a model that fails
        to load or a bad flag (Triton exits with an error status), a timeout."""
        self.check_memory_plan()
        install = find_server(self.options.server)
        cmd, env = self.command(install, build_backend_dir(install)), server_env(install)
        logger.info("Starting %s", " ".join(cmd))
        # Whatever this process's end, the reaper takes the server's group down (reaper.py).
        self.reaper = Reaper()
        try:
            for attempt in range(1, STARTUP_ATTEMPTS + 1):
                self._launch(cmd, env, attempt)
                try:
                    self.wait_ready()
                    break
                except ServerCrashedAtStartup as crash:
                    if attempt == STARTUP_ATTEMPTS:
                        raise
                    self.startup_retries += 1
                    logger.warning("%s; starting it again (retry %d of at most %d)", crash, self.startup_retries,
                                   STARTUP_ATTEMPTS - 1)
                    self._take_down()
        except BaseException:
            self.stop()
            raise
        # Seen now, while every engine runs: a server that dies takes its stubs' view of them along.
        self._segments = mapped_shared_memory(process_group(self.process.pid))
        if self.options.supervise:
            api = RepositoryApi(self.http_url, ADMIN_HEADER, self.admin_key)
            self.supervisor = Supervisor(self.process.pid, api, self.run_dir).start()
        return self

    def _launch(self, cmd: list[str], env: dict[str, str], attempt: int) -> None:
        """One tritonserver process, in a process group of its own (stop() then reaches the stubs
        and their engine processes), watched by the reaper."""
        output = None
        if self.options.log_file is not None:
            self.options.log_file.parent.mkdir(parents=True, exist_ok=True)
            # A retry appends: the crash that caused it stays in the log.
            output = self._log = open(self.options.log_file, "wb" if attempt == 1 else "ab")  # noqa: SIM115
            self._log_start = output.tell()
            if attempt > 1:
                output.write(f"\n--- triton-omni: start attempt {attempt} of {STARTUP_ATTEMPTS} ---\n".encode())
                output.flush()
        self.process = subprocess.Popen(cmd, env=env | {"TRITON_OMNI_RUN_DIR": str(self.run_dir)}, stdout=output,
                                        stderr=subprocess.STDOUT if output else None, start_new_session=True,
                                        preexec_fn=_reap_children_of_the_server)
        self._identity = identity(self.process.pid)  # read now: once the process is reaped, /proc forgets it
        self.reaper.watch(self.leftovers())

    def leftovers(self, run_dir: bool = True) -> Leftovers:
        """What this server may leave behind: its process group; the Python backend's regions (its
        prefix); the folders its stubs share under /dev/shm and the temporary folder (named by the
        server process's identity, processes.server_folder); with ``run_dir``, its run folder."""
        server = self._identity
        engines = Path(tempfile.gettempdir()) / f"triton-omni-engines-{server}"
        return Leftovers(self.process.pid, shm_patterns=[self.shm_prefix + "*", f"triton-omni-load-{server}"],
                         paths=[str(engines), *([str(self.run_dir)] if run_dir else [])])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        silence = _Silence(self.options.log_file, self.options.startup_stall_s, self._loading_stubs_cpu_seconds)
        while time.monotonic() < deadline:
            if (code := self.process.poll()) is not None:
                failure = ServerCrashedAtStartup if -code in STARTUP_CRASHES else RuntimeError
                raise failure(f"tritonserver {describe_exit(code)} during startup" + self._startup_report())
            if silence.too_long():
                self._dump_stacks_of_loading_stubs()
                raise ServerHungAtStartup(f"tritonserver's load made no progress for {silence.limit_s:.0f} s (its "
                                          "log silent; the stacks of the stubs still loading are in it)"
                                          + self._startup_report())
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {self.options.startup_timeout_s:.0f} s"
                           + self._startup_report())

    def _dump_stacks_of_loading_stubs(self, wait_s: float = 2.0) -> None:
        """Each stub of a model still loading writes its threads' stacks into the log (``STACKS_SIGNAL``)."""
        loading = set(still_loading(self._attempt_log()))
        for stub in server_stubs(self.process.pid):
            if stub.model in loading:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stub.pid, STACKS_SIGNAL)
        time.sleep(wait_s)

    def _loading_stubs_cpu_seconds(self) -> float:
        loading = set(still_loading(self._attempt_log()))
        return sum(stub.cpu_s for stub in server_stubs(self.process.pid) if stub.model in loading)

    def _attempt_log(self) -> str:
        """This start attempt's part of the log (a retry appends to the same file)."""
        log_file = self.options.log_file
        if log_file is None or not log_file.exists():
            return ""
        with open(log_file, "rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")

    def _startup_report(self) -> str:
        """Where the log is and what its models were doing: a CI run shows only the exception."""
        log_file = self.options.log_file
        if log_file is None or not log_file.exists():
            return ""
        return f"; see {log_file}\n" + startup_report(self._attempt_log())

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGINT (Triton's graceful shutdown: requests in flight get ``exit_timeout_s`` to finish,
        new ones are refused), then, ``timeout_s`` later (that plus the models' unloading by
        default), SIGKILL for whatever of the process group is left: stubs and vLLM engine
        processes included."""
        timeout_s = self.options.exit_timeout_s + UNLOAD_S if timeout_s is None else timeout_s
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.process is not None:
            if self.process.poll() is None:
                # and now: stubs the supervisor loaded again since the start have segments of their own
                self._segments |= mapped_shared_memory(process_group(self.process.pid))
                self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("tritonserver did not stop in %.0f s; killing it", timeout_s)
            self._take_down()
        self._remove_run_dir()
        if self.reaper is not None:
            self.reaper.close()
        return self.process.returncode if self.process is not None else None

    def _take_down(self) -> None:
        """Whatever is left of the server's group killed, and what it left in /dev/shm removed (what a
        killed process had no chance to unlink); the run folder stays, for a start again."""
        reap(self.leftovers(run_dir=False), self._segments)
        self.process.wait()
        if self._log:
            self._log.close()
            self._log = None
        self._log_start = 0  # where this start attempt's lines begin in the log

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerCrashedAtStartup(RuntimeError):
    """tritonserver died of a crash (``STARTUP_CRASHES``) before it was ready: worth another start."""


class ServerHungAtStartup(ServerCrashedAtStartup):
    """tritonserver's load made no progress for ``startup_stall_s``: taken down, worth another start."""


def _reap_children_of_the_server() -> None:
    """Runs in the server's process before exec: its dead children are reaped by the kernel.

    Why: Triton 2.51 waits for a stub's exit only when it unloads that stub's
    instance, and an instance whose stub was killed mid-request is never
    unloaded (Triton keeps it for the request it forgot), so the dead stub
    stayed a zombie until the server stopped. An ignored SIGCHLD survives
    exec; Triton's own waits still return once a stub is gone. The stubs set
    it back to the default as they start (``triton_omni.triton``), so that
    Python's process handling in them works as usual."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)


def access_summary(options: ServerOptions, restarts: RestartPolicy | None = None) -> str:
    """What the server exposes, and to whom: said at startup."""
    loopback = " (loopback only; --bind 0.0.0.0 to serve other hosts)" if options.bind.startswith("127.") else ""
    has_key = options.admin_key or os.environ.get("TRITON_OMNI_ADMIN_KEY")
    admin = "open with that header, key from $TRITON_OMNI_ADMIN_KEY" if has_key else \
        "closed: set TRITON_OMNI_ADMIN_KEY to open them with that header"
    supervised = "\n  supervised: a model whose stub dies is unloaded and loaded again" if options.supervise else ""
    placed = f"\n  placement: {' '.join(options.placement)}" if options.placement else ""
    if options.demo != "sd":
        placed += f"\n  demo family: {options.demo} (ar_encoder and diffusion)"
    if restarts is not None:
        supervised += (f"\n  restarted: tritonserver, if it dies, at most {restarts.max_restarts} times in "
                       f"{restarts.window_s / 60:.0f} min")
    return (f"  bound to {options.bind}{loopback}{supervised}{placed}\n"
            f"  open: inference, health, metadata, model config, statistics\n"
            f"  restricted: {', '.join(RESTRICTED_APIS)} (header {ADMIN_HEADER}; {admin})")


def serve(options: ServerOptions, restarts: RestartPolicy | None = None) -> int:
    """Run until Ctrl-C / SIGTERM, then stop the server and everything it started.

    ``restarts``: a server that dies unasked (a signal, an abort, an error
    status) is stopped for good (its process group, its shared memory) and
    started again under this policy; ``None`` ends ``serve`` with it instead."""
    from triton_omni.demo_models import build_all

    server = TritonServer(options)  # a placement it cannot serve fails here, before any work
    build_all()
    # Until the server is ready, Ctrl-C raises KeyboardInterrupt and start() cleans up.
    server.start()
    gateway = None
    if options.openai_port:
        gateway = Gateway(options.openai_port, options.bind, server.grpc_url,
                          text_model_tokenizers(server.repositories), options.api_key, options.openai_workers)
        try:
            gateway.start()
        except BaseException:
            server.stop()
            raise
    stop_requested = threading.Event()
    starting_again = threading.Event()

    def request_stop(signum, frame):
        stop_requested.set()
        if starting_again.is_set():  # a restart's start() waits for readiness: cut it short
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    keyed = " (API key required)" if options.api_key or os.environ.get(API_KEY_ENV) else " (no API key)"
    openai = f"  OpenAI   http://{gateway.url}/v1{keyed}\n" if gateway else ""
    print(f"triton-omni is ready:\n  HTTP     http://{server.http_url}\n  gRPC     {server.grpc_url}\n"
          f"  metrics  {server.metrics_url}\n{openai}{access_summary(options, restarts)}\nPress Ctrl-C to stop.",
          flush=True)
    try:
        while True:
            while not stop_requested.is_set() and server.process.poll() is None:
                stop_requested.wait(0.5)
            if stop_requested.is_set() or restarts is None or not died_abnormally(server.process.returncode):
                break
            replacement = _restart(server, options, restarts, stop_requested, starting_again)
            if replacement is None:
                break
            server = replacement
    except KeyboardInterrupt:  # Ctrl-C during a restart; start() has cleaned up after itself
        pass
    finally:
        if gateway is not None:
            gateway.stop()
        code = server.stop()
    return 0 if stop_requested.is_set() else (code or 1)


def _restart(dead: TritonServer, options: ServerOptions, restarts: RestartPolicy,
             stop_requested: threading.Event, starting: threading.Event) -> TritonServer | None:
    """A new server in place of ``dead`` (readiness is false meanwhile: nothing listens);
    ``None`` when the policy's budget is spent or a stop was asked for."""
    code = dead.process.returncode
    while (delay := restarts.next_delay()) is not None:
        logger.error("tritonserver %s; restarting it in %.0f s (restart %d of at most %d in %.0f min)",
                     describe_exit(code), delay, restarts.recent, restarts.max_restarts, restarts.window_s / 60)
        dead.stop()
        if stop_requested.wait(delay):
            return None
        started = time.monotonic()
        server = TritonServer(options)
        starting.set()
        try:
            server.start()
        except (RuntimeError, TimeoutError) as exc:
            logger.error("tritonserver failed to start again: %s", exc)
            dead, code = server, server.process.returncode if server.process else 1
            continue
        finally:
            starting.clear()
        logger.warning("tritonserver is serving again, %.1f s after its restart began", time.monotonic() - started)
        return server
    logger.error("tritonserver %s; not restarting it: %d restarts within %.0f min already", describe_exit(code),
                 restarts.max_restarts, restarts.window_s / 60)
    return None
