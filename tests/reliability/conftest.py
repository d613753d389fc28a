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
def supervised(tmp_path_factory):
    build_all()
    log_file = Path(tmp_path_factory.mktemp("logs") / "tritonserver.log")
    server = TritonServer(ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                        log_file=log_file, supervise=True, admin_key="reliability")).start()
    yield server
    server.stop()
