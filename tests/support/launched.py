"""A launcher of its own, in a child process: it starts a tritonserver (or a gateway) through the
launcher, says what it started, and then ends as the test tells it (killed, or by an uncaught
exception), so that a test can check that nothing it started outlives it (reaper.py)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from triton_omni_tools.launcher import PROJECT_ROOT

PARENT = '''
import json, sys, time
from pathlib import Path
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port
from triton_omni_tools.gateway import Gateway

what, repository, log_file, end = sys.argv[1:]
if what == "server":
    started = TritonServer(ServerOptions(model_repositories=[Path(repository)], http_port=free_port(),
                                         grpc_port=free_port(), metrics_port=free_port(),
                                         log_file=Path(log_file))).start()
    names = {"shm_prefix": started.shm_prefix, "run_dir": str(started.run_dir), "http": started.http_url,
             "grpc": started.grpc_url}
else:
    started = Gateway(free_port(), "127.0.0.1", f"localhost:{free_port()}", {}, workers=2).start()
    names = {"metrics_dir": started.metrics_dir}
print(json.dumps({"pgid": started.process.pid, **names}), flush=True)
if end == "exception":
    raise RuntimeError("the launcher's script fails with its server running")
time.sleep(3600)
'''


@contextlib.contextmanager
def launched(what: str, repository: Path, log_file: Path, end: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    """The launcher's script started (``what``: "server" or "gateway"; ``end``: "exception" to end by
    one once started, else it waits to be killed), and what it said it started once that was ready.
    On leaving, the script is killed if it still runs: a failed check leaves no launcher waiting
    (its reaper then takes the rest)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, what, str(repository), str(log_file), end],
                              cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        assert line, f"the launcher's script ended without starting its {what}; see {log_file}"
        yield parent, json.loads(line)
    finally:
        parent.kill()
        parent.wait()
