"""Helpers for tests against a real tritonserver: the models both engines
serve, process-group checks, metric reads, the server-alive guard."""

from __future__ import annotations

import contextlib
import os
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from triton_omni.demo_models import build_all
from triton_omni_client.client import batched_inputs
from triton_omni_tools.launcher import PROJECT_ROOT, ServerOptions, TritonServer, free_port, process_group
from triton_omni_tools.repository import copy_model

GENERATE_MODELS = ["ar", "ar_transformers"]
ENCODE_MODELS = ["ar_encoder", "ar_encoder_transformers"]


def diffusion_alone(tmp_path_factory, parameters: dict[str, str]):
    """A server of its own whose only model is ``diffusion`` with ``parameters`` (the
    multi-process modes); on leaving, every process it started is gone, workers included."""
    build_all()
    repository = tmp_path_factory.mktemp("diffusion")
    copy_model(PROJECT_ROOT / "model_repository", "diffusion", repository, parameters=parameters)
    triton = TritonServer(ServerOptions(model_repositories=[repository], http_port=free_port(),
                                        grpc_port=free_port(), metrics_port=free_port(),
                                        log_file=tmp_path_factory.mktemp("logs") / "tritonserver.log",
                                        startup_stall_s=240)).start()
    pgid = triton.process.pid
    yield triton
    triton.stop()
    assert_group_gone(pgid)


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


def children(pid: int) -> set[int]:
    """The child processes of ``pid`` (of all its threads)."""
    return {int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, whatever its process group (tritonserver has one of its own)."""
    found, todo = [], [pid]
    while todo:
        try:
            below = children(todo.pop())
        except OSError:  # gone meanwhile
            continue
        found.extend(below)
        todo.extend(below)
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def engine_cores(server: TritonServer) -> list[int]:
    """The vLLM engine core processes the server's stubs started."""
    return [pid for pid in process_group(server.process.pid)
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")]


def require_alive(server: TritonServer) -> None:
    """Stop the whole run, showing the server's last log lines, once the
    server has died: every later test would only fail with 'connection refused'."""
    code = server.process.poll()
    if code is not None:
        tail = "\n".join(server.options.log_file.read_text(errors="replace").splitlines()[-60:])
        pytest.exit(f"tritonserver exited with code {code}; last log lines:\n{tail}", returncode=3)


def metric_value(server: TritonServer, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        is_sample = line.startswith((name + "{", name + " "))
        if is_sample and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


GATEWAY_METRICS_HEADING = "## The OpenAI gateway's metrics"


def documented_metrics(gateway: bool = False) -> dict[str, str]:
    """name -> kind, from the tables in docs/metrics.md: the server's, or (``gateway``) the
    OpenAI gateway's, which it serves on its own port."""
    server, _, gateway_part = (PROJECT_ROOT / "docs" / "metrics.md").read_text().partition(GATEWAY_METRICS_HEADING)
    table = gateway_part if gateway else server
    return dict(re.findall(r"^\| `(omni_\w+)` \| (counter|gauge|histogram) \|", table, flags=re.M))


def text_to_image(url: str, protocol: str, prompt: str, negative: str | None = None, **options) -> np.ndarray:
    """One image from the ``text_to_image`` ensemble (``negative`` None: no negative prompt sent)."""
    module = grpcclient if protocol == "grpc" else httpclient
    inputs = batched_inputs(module, text_input=prompt, negative_prompt=negative, **options)
    with module.InferenceServerClient(url) as client:
        return client.infer("text_to_image", inputs).as_numpy("image")[0]


# `make test-reliability` sets it: the reliability suite in full (tests/reliability/conftest.py).
LONG_RELIABILITY = os.environ.get("TRITON_OMNI_RELIABILITY") == "long"


def model_ready(server: TritonServer, model: str) -> bool:
    """What a readiness probe reads: ``/v2/models/<model>/ready`` answers 200."""
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/ready", timeout=2) as response:
            return response.status == 200
    except OSError:  # URLError (a 400 included), refused, timed out
        return False


# Triton 2.51 aborts (boost::interprocess::lock_exception, signal 6) when it next takes a shared-memory
# lock that a SIGKILLed stub held as it died; the stub's last IPC decides, not this project
# (docs/operations.md, "What it cannot do"). Seen once in about ten CI runs of the stub-kill tests.
TRITON_LOCK_ABORT = "lock_exception"


def xfail_if_triton_aborted_on_a_dead_stub(server: TritonServer) -> None:
    """After killing a stub: if tritonserver died of that Triton defect, say so (xfail) rather than
    fail on what follows from it; any other death of the server is left to the test's assertions."""
    if server.process.poll() is None or server.options.log_file is None:
        return
    log = server.options.log_file.read_text(errors="replace")
    if TRITON_LOCK_ABORT in log:
        pytest.xfail(f"tritonserver 2.51 aborted on the killed stub's shared-memory lock ({TRITON_LOCK_ABORT}): "
                     "a Triton defect, documented in docs/operations.md")


@contextlib.contextmanager
def serving_openai(options: ServerOptions, chat: bool = False):
    """A tritonserver with ``options`` and the OpenAI gateway in front of it, as `serve` runs them:
    the server, its ``openai`` attribute an ``openai.OpenAI`` client of the gateway, its
    ``gateway_url`` the gateway's. ``chat``: the gateway knows the text and speech models'
    tokenizers (chat templates, ``/v1/audio/speech``), as `serve` passes them."""
    import openai
    from triton_omni_tools.gateway import Gateway, text_model_tokenizers

    with TritonServer(options) as server:
        tokenizers = text_model_tokenizers(server.repositories) if chat else {}
        gateway = Gateway(free_port(), "127.0.0.1", server.grpc_url, tokenizers).start()
        try:
            server.gateway_url = f"http://{gateway.url}"
            server.openai = openai.OpenAI(base_url=f"{server.gateway_url}/v1", api_key="unused")
            yield server
        finally:
            gateway.stop()
