"""The reliability suite: a supervised server (the launcher's supervisor on,
as `omni-triton serve` runs it), killed stubs, bad inputs.

`make test` runs the short version; `make test-reliability` sets
``TRITON_OMNI_RELIABILITY=long``: every Python model's stub killed, the whole
bad-input corpus on both protocols, and the Locust soak.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from triton_omni.demo_models import build_all
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port


@pytest.fixture(scope="session")
def _supervised_servers(tmp_path_factory):
    """Starts a supervised server on demand; stops every one it started."""
    started: list[TritonServer] = []

    def start() -> TritonServer:
        build_all()
        log_file = Path(tmp_path_factory.mktemp("logs") / "tritonserver.log")
        options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                log_file=log_file, supervise=True, admin_key="reliability")
        started.append(TritonServer(options).start())
        return started[-1]

    yield start, started
    for server in started:
        server.stop()


@pytest.fixture
def supervised(_supervised_servers) -> TritonServer:
    """The suite's supervised server; a fresh one if a stub kill took the last one down
    (a Triton 2.51 abort, which that test reports: tests/support/server.py)."""
    start, started = _supervised_servers
    if not started or started[-1].process.poll() is not None:
        return start()
    return started[-1]
