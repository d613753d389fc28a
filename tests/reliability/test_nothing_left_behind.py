"""A server or gateway started through the launcher dies with the process that started it, however
that process ends (SIGKILL, SIGTERM's default action, an uncaught exception): no process of its group
and nothing of what it made in /dev/shm or the temporary folder is left (reaper.py). And a start whose
tritonserver crashes before it is ready is retried; one that fails for good is not.

The server here is a real tritonserver with a small Python-backend model (``engine``) that does what a
vLLM engine does at load: it spawns a child process and makes a multiprocessing semaphore and a shared
memory segment (``sem.mp-*``, ``psm_*``), and a load record like the batched stages' (balance.py); once,
where told, it aborts the server or never finishes loading. The
same checks on a GPU, with GPU memory, are in tests/gpu/test_nothing_left_behind.py."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port
from triton_omni_tools.reaper import SHM, mapped_shared_memory, process_group

from tests.support.launched import launched
from tests.support.server import assert_group_gone

ENGINE_MODEL = '''
import multiprocessing
import multiprocessing.shared_memory
import os
import signal
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from triton_omni.triton.balance import InstanceLoads


class TritonPythonModel:
    def initialize(self, args):
        crash_once = Path(__file__).parent / "crash-once"
        if crash_once.exists():  # Triton's startup abort, once: the launcher must start the server again
            crash_once.unlink()
            os.kill(os.getppid(), signal.SIGABRT)
            return
        hang_once = Path(__file__).parent / "hang-once"
        if hang_once.exists():  # a load that never ends, once: the launcher must start the server again
            hang_once.unlink()
            self.never_loads()
        context = multiprocessing.get_context("spawn")
        self.lock = context.Lock()  # a named semaphore in /dev/shm (sem.mp-*) under spawn
        self.segment = multiprocessing.shared_memory.SharedMemory(create=True, size=1 << 20)  # psm_*
        self.core = context.Process(target=time.sleep, args=(3600,), daemon=True)  # stands for an engine core
        self.core.start()
        self.loads = InstanceLoads("engine", args["model_instance_name"], instances=2)

    def never_loads(self):
        time.sleep(3600)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])
                for _ in requests]
'''

ENGINE_CONFIG = '''
name: "engine"
backend: "python"
max_batch_size: 0
input [{ name: "IN", data_type: TYPE_INT64, dims: [1] }]
output [{ name: "PID", data_type: TYPE_INT64, dims: [1] }]
instance_group [{ kind: KIND_CPU, count: 2 }]
'''

def engine_repository(folder: Path, crash_once: bool = False, hang_once: bool = False) -> Path:
    """With ``crash_once``, one instance, whose first load aborts the server (a second instance's
    stub could outlive the server it started under); with ``hang_once``, one whose first load
    never ends."""
    model = folder / "engine"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(ENGINE_MODEL)
    alone = crash_once or hang_once
    (model / "config.pbtxt").write_text(ENGINE_CONFIG.replace("count: 2", "count: 1") if alone else ENGINE_CONFIG)
    for marker, wanted in (("crash-once", crash_once), ("hang-once", hang_once)):
        if wanted:
            (model / "1" / marker).touch()
    return folder


def made_by(group: list[int], shm_prefix: str) -> set[str]:
    """What a server's group has in /dev/shm (other servers may run beside the test): what its processes
    map, its Python backend regions, its stubs' load records."""
    return ({path.name for path in mapped_shared_memory(group)} | {path.name for path in SHM.glob(shm_prefix + "*")}
            | {path.name for path in SHM.glob(f"triton-omni-load-{group[0]}-*")})


@pytest.mark.parametrize(("what", "end"), [("server", "SIGKILL"), ("server", "SIGTERM"), ("server", "exception"),
                                           ("gateway", "SIGKILL")])
def test_what_the_launcher_started_dies_with_it(tmp_path, what, end):
    with launched(what, engine_repository(tmp_path / "repo"), tmp_path / "tritonserver.log", end) as (parent, started):
        check_dies_with_its_launcher(parent, started, what, end)


def check_dies_with_its_launcher(parent, started: dict, what: str, end: str) -> None:
    pgid = started["pgid"]
    group = sorted(process_group(pgid), key=lambda pid: pid != pgid)
    made = set()
    if what == "server":
        with httpclient.InferenceServerClient(started["http"]) as client:
            inputs = [httpclient.InferInput("IN", [1], "INT64")]
            inputs[0].set_data_from_numpy(np.array([1], np.int64))
            client.infer("engine", inputs)
        made = made_by(group, started["shm_prefix"])
        # what the test stands for: stubs, their engine processes, the Python backend's regions,
        # a spawned process's semaphore and segment, the stubs' load records
        assert len(group) >= 5, group
        assert any(name.startswith(started["shm_prefix"]) for name in made), made
        assert any(name.startswith("sem.mp-") for name in made) and any(name.startswith("psm_") for name in made)
        assert any(name.startswith("triton-omni-load-") for name in made), made
    else:
        assert len(group) >= 3, group  # uvicorn's main process and its two workers
        assert Path(started["metrics_dir"]).is_dir()
    if end != "exception":
        parent.send_signal(getattr(signal, end))
    assert parent.wait(60) != 0
    assert_group_gone(pgid, timeout_s=30)
    deadline = time.monotonic() + 10  # the reaper removes the files once the group is gone
    while (left := {name for name in made if (SHM / name).exists()}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left in /dev/shm: {sorted(left)}"
    if what == "server":
        assert not Path(started["run_dir"]).exists()
        assert not list(Path(tempfile.gettempdir()).glob(f"triton-omni-engines-{pgid}-*"))
    else:
        assert not Path(started["metrics_dir"]).exists()


def test_a_server_that_crashes_while_starting_is_started_again(tmp_path):
    """The first tritonserver aborts while loading its models, as Triton 2.51's lock_exception does: start()
    starts another, says so in the log, counts it, and the server it returns serves."""
    log_file = tmp_path / "tritonserver.log"
    options = ServerOptions(model_repositories=[engine_repository(tmp_path / "repo", crash_once=True)],
                            http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=log_file)
    with TritonServer(options) as server:
        assert server.startup_retries == 1
        assert "start attempt 2 of 3" in log_file.read_text(errors="replace")
        with httpclient.InferenceServerClient(server.http_url) as client:
            assert client.is_model_ready("engine")
        pgid = server.process.pid
    assert_group_gone(pgid)


def test_a_start_whose_load_hangs_writes_the_stubs_stacks_and_is_started_again(tmp_path):
    """The first start's model never finishes loading and the log stays silent: past
    ``startup_stall_s`` the stub writes its stacks into the log (where it hung: ``never_loads``), and
    the server is started again, and serves."""
    log_file = tmp_path / "tritonserver.log"
    options = ServerOptions(model_repositories=[engine_repository(tmp_path / "repo", hang_once=True)],
                            http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=log_file,
                            startup_stall_s=6)
    with TritonServer(options) as server:
        assert server.startup_retries == 1
        log = log_file.read_text(errors="replace")
        first = log.split("start attempt 2 of 3")[0]
        assert "in never_loads" in first and "in initialize" in first, first[-3000:]
        with httpclient.InferenceServerClient(server.http_url) as client:
            assert client.is_model_ready("engine")
        pgid = server.process.pid
    assert_group_gone(pgid)


def test_a_start_that_fails_for_good_is_not_retried(tmp_path):
    """A model that cannot load: Triton exits with an error status, which another start would not change."""
    repository = engine_repository(tmp_path / "repo")
    (repository / "engine" / "config.pbtxt").write_text(ENGINE_CONFIG.replace("TYPE_INT64, dims: [1] }]\noutput",
                                                                              "TYPE_NO_SUCH, dims: [1] }]\noutput"))
    log_file = tmp_path / "tritonserver.log"
    server = TritonServer(ServerOptions(model_repositories=[repository], http_port=free_port(),
                                        grpc_port=free_port(), metrics_port=free_port(), log_file=log_file))
    with pytest.raises(RuntimeError, match="exited with status 1 during startup") as failure:
        server.start()
    assert server.startup_retries == 0
    assert "start attempt 2" not in log_file.read_text(errors="replace")
    assert "failed to load engine" in str(failure.value) or "TYPE_NO_SUCH" in log_file.read_text(errors="replace")
    assert not server.run_dir.exists() and not os.path.exists(server.run_dir)
