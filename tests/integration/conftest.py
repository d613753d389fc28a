"""One real tritonserver for the integration tests.

It serves the default repositories (``model_repository/`` with engine
``auto`` = vLLM here, and ``ensemble/``) plus a repository of variants:
``*_transformers`` copies of the AR configs, so both engines pass the same
behaviour tests, and ``omni_small_budget``, an ``omni`` whose admission
budget is smaller than one prompt's embeddings.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from pathlib import Path

import pytest
from triton_omni.demo_models import build_all
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, PROJECT_ROOT, ServerOptions, TritonServer

DEFAULT_REPOSITORY = PROJECT_ROOT / "model_repository"
GENERATE_MODELS = ["ar", "ar_transformers"]
ENCODE_MODELS = ["ar_encoder", "ar_encoder_transformers"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def make_variant(repository: Path, source: str, name: str, **parameters: str) -> None:
    """Copy a model config from the default repository, overriding parameters."""
    config = (DEFAULT_REPOSITORY / source / "config.pbtxt").read_text()
    for key, value in parameters.items():
        config, count = re.subn(rf'(key: "{key}" value {{ string_value: ")[^"]*(")', rf"\g<1>{value}\g<2>", config)
        assert count == 1, f"parameter {key} not found in {source}"
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(config)


def process_group(pgid: int) -> list[int]:
    """Live processes of a process group (server, stubs, engine processes)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def assert_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := process_group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {[_cmdline(p) for p in left]}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return str(pid)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    build_all()
    variants = tmp_path_factory.mktemp("variants")
    make_variant(variants, "ar", "ar_transformers", engine="transformers")
    make_variant(variants, "ar_encoder", "ar_encoder_transformers", engine="transformers")
    make_variant(variants, "omni", "omni_small_budget", max_embeds_bytes_in_flight="1000", admission_policy="reject")
    log_file = Path(os.environ.get("TRITON_OMNI_TEST_LOG", tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    options = ServerOptions(
        model_repositories=[*DEFAULT_REPOSITORIES, variants],
        http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        log_file=log_file,
    )
    triton = TritonServer(options).start()
    yield triton
    pgid = triton.process.pid
    assert len(process_group(pgid)) > 1, "expected the server and its stubs in one process group"
    triton.stop()
    assert_group_gone(pgid)
    shutil.copy(log_file, PROJECT_ROOT / ".cache" / "last-test-server.log")


def require_alive(server: TritonServer) -> None:
    """Stop the whole run, showing the server's last log lines, once the
    server has died: every later test would only fail with 'connection refused'."""
    code = server.process.poll()
    if code is not None:
        tail = "\n".join(server.options.log_file.read_text(errors="replace").splitlines()[-60:])
        pytest.exit(f"tritonserver exited with code {code}; last log lines:\n{tail}", returncode=3)


@pytest.fixture(autouse=True)
def _server_still_alive(request):
    """Checked after every test that used the server."""
    yield
    if "server" in request.fixturenames:
        require_alive(request.getfixturevalue("server"))


@pytest.fixture
def grpc_url(server) -> str:
    require_alive(server)
    return server.grpc_url


@pytest.fixture
def http_url(server) -> str:
    require_alive(server)
    return server.http_url


def metric_value(server, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    import urllib.request

    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        is_sample = line.startswith((name + "{", name + " "))
        if is_sample and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
