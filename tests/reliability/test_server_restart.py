"""`omni-triton serve` (what `make serve` runs) from start to stop: ready with the default models
and the OpenAI gateway, then it brings tritonserver back when it dies (Triton 2.51 aborts on its
own now and then, a `lock_exception` after a stub is killed; SIGABRT stands in for that abort):
ready again within 120 s, every model answering, the launcher saying what it did. Ctrl-C then
stops it cleanly (no traceback) and leaves no server, stub or engine process behind."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import tritonclient.grpc as grpcclient
from triton_omni_client import OmniClient
from triton_omni_client.client import batched_inputs, omni_inputs, stream_infer
from triton_omni_tools.launcher import free_port

from tests.support.server import alive, assert_group_gone, children, descendants

FAST = {"num_inference_steps": 2, "height": 32, "width": 32, "guidance_scale": 1.0}


def ready(http: int, path: str = "/v2/health/ready") -> bool:
    try:
        with urllib.request.urlopen(f"http://localhost:{http}{path}", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _is_tritonserver(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"tritonserver")
    except OSError:
        return False


def tritonserver_of(launcher: int) -> int:
    [server] = [pid for pid in children(launcher) if _is_tritonserver(pid)]
    return server


def every_model_answers(grpc: str) -> None:
    client = OmniClient(grpc)
    assert client.encode("a red fox").shape[0] > 0
    assert client.generate_image(prompt="a red fox", seed=1, **FAST).shape == (32, 32, 3)
    with grpcclient.InferenceServerClient(grpc) as raw:
        inputs = batched_inputs(grpcclient, text_input="a red fox", negative_prompt="", seed=1, **FAST)
        assert raw.infer("text_to_image", inputs).as_numpy("image").shape == (1, 32, 32, 3)
    for model, values in (("ar", {"text_input": "a red fox", "max_tokens": 4}),
                          ("omni", {"text_input": "a red fox", "modalities": ["text"], "max_tokens": 4})):
        assert list(stream_infer(grpc, model, omni_inputs(grpcclient, values))), model


START_S = 600  # a full `serve` start on a 2-core CI machine, with every stub importing at once


def what_went_wrong(log_path: Path) -> str:
    """Triton's error lines and the models it could not load, then the log's tail."""
    text = log_path.read_text(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith("E") or "UNAVAILABLE" in line]
    return "\n".join(errors[-20:]) + "\n...\n" + text[-2000:]


def wait_until_serving(launcher: subprocess.Popen, log_path: Path) -> None:
    """The launcher's own word, not the server's readiness: it starts watching the server then."""
    deadline = time.monotonic() + START_S
    while b"triton-omni is ready" not in log_path.read_bytes():
        assert launcher.poll() is None, what_went_wrong(log_path)
        assert time.monotonic() < deadline, "serve did not become ready"
        time.sleep(0.5)


def no_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGABRT would otherwise leave a core file


@contextlib.contextmanager
def serving(tmp_path: Path, *flags: str):
    """`omni-triton serve FLAGS` on free ports, once it says it is ready: (launcher, HTTP port, gRPC
    port, log path). Afterwards nothing of its process group is left."""
    http, grpc, metrics, openai = free_port(), free_port(), free_port(), free_port()
    log_path = tmp_path / "serve.log"
    cli = Path(sys.executable).parent / "omni-triton"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(
            [str(cli), "serve", *flags, f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
             f"--openai-port={openai}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=no_core_dumps)
    try:
        wait_until_serving(launcher, log_path)
        yield launcher, http, grpc, openai, log_path
    finally:
        if launcher.poll() is None:  # a failed test: stop it as Ctrl-C does, so that it cleans up after itself
            servers = [pid for pid in children(launcher.pid) if _is_tritonserver(pid)]
            launcher.send_signal(signal.SIGINT)
            try:
                launcher.wait(timeout=90)
            except subprocess.TimeoutExpired:
                # tritonserver has a process group of its own: killing the launcher's would orphan it
                for group in [*servers, launcher.pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(group, signal.SIGKILL)
    assert_group_gone(launcher.pid)


def test_serve_restarts_tritonserver_after_an_abort_and_stops_cleanly_on_ctrl_c(tmp_path):
    with serving(tmp_path) as (launcher, http, grpc, openai, log_path):
        assert f"OpenAI   http://127.0.0.1:{openai}/v1 (no API key)" in log_path.read_text(errors="replace")
        with urllib.request.urlopen(f"http://localhost:{openai}/v1/models") as response:
            assert {"ar", "omni", "text_to_image"} <= {model["id"] for model in json.loads(response.read())["data"]}
        first = tritonserver_of(launcher.pid)
        os.kill(first, signal.SIGABRT)

        aborted = time.monotonic()
        seen_not_ready = gateway_said_so = False
        while not (ready(http) and seen_not_ready):
            seen_not_ready |= not ready(http)
            gateway_said_so |= not ready(openai, "/health")  # the OpenAI gateway stays up and answers 503
            assert launcher.poll() is None, what_went_wrong(log_path)
            # a restart is a whole start again: on two busy cores, as long as the first one may take
            assert time.monotonic() - aborted < START_S, "not ready again in time:\n" + what_went_wrong(log_path)
            time.sleep(0.5)
        assert tritonserver_of(launcher.pid) != first
        every_model_answers(f"localhost:{grpc}")
        assert gateway_said_so
        back = time.monotonic() + 10  # its gRPC channel retries at least every second
        while not ready(openai, "/health"):
            assert time.monotonic() < back, "the OpenAI gateway did not see Triton again"
            time.sleep(0.2)

        # the launcher polls readiness on its own clock: it may say so after this test saw it
        logged = time.monotonic() + 30
        while "tritonserver is serving again" not in (output := log_path.read_text(errors="replace")):
            assert time.monotonic() < logged, output[-3000:]
            time.sleep(0.2)
        assert "tritonserver killed by SIGABRT; restarting it" in output, output[-3000:]
        restarted = len(output)
        below = descendants(launcher.pid)
        launcher.send_signal(signal.SIGINT)  # Ctrl-C
        assert launcher.wait(timeout=120) == 0
        assert not [pid for pid in below if alive(pid)], "processes left behind"
        # a clean stop: vLLM's AsyncLLM used to print a TypeError traceback from __del__ at every stop
        stop = log_path.read_text(errors="replace")[restarted:]
        assert "Traceback" not in stop and "Exception ignored" not in stop, stop[-3000:]


def test_no_restart_exits_with_the_server(tmp_path):
    """`--no-restart`: the launcher ends with the server, for a supervisor of the user's own."""
    with serving(tmp_path, "--no-restart", "--model-control-mode=explicit", "--load-model=diffusion") as (
            launcher, _, _, _, log_path):
        os.kill(tritonserver_of(launcher.pid), signal.SIGABRT)
        assert launcher.wait(timeout=120) != 0
    assert "restarting it" not in log_path.read_text(errors="replace")
