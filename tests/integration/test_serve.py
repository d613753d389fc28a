"""`omni-triton serve` (what `make serve` runs): ready with the default models,
stops on Ctrl-C, cleanly (no traceback), and leaves no server, stub or engine
process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from triton_omni_tools.launcher import free_port

from tests.support.server import assert_group_gone


def test_serve_ready_then_ctrl_c_leaves_nothing_behind(tmp_path):
    http, grpc, metrics, openai = free_port(), free_port(), free_port(), free_port()
    cli = Path(sys.executable).parent / "omni-triton"
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(
        [str(cli), "serve", f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
         f"--openai-port={openai}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while b"is ready" not in (tmp_path / "serve.log").read_bytes():
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "serve did not become ready"
            time.sleep(0.5)
        for model in ("ar", "ar_encoder"):
            with urllib.request.urlopen(f"http://localhost:{http}/v2/models/{model}/ready") as response:
                assert response.status == 200
        assert f"OpenAI   http://127.0.0.1:{openai}/v1 (no API key)" in (tmp_path / "serve.log").read_text()
        with urllib.request.urlopen(f"http://localhost:{openai}/v1/models") as response:  # the OpenAI gateway
            assert {"ar", "omni", "text_to_image"} <= {model["id"] for model in json.loads(response.read())["data"]}
        children = _descendants(process.pid)
        assert children, "expected tritonserver and its stubs"
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=120) == 0
        for pid in children:
            assert not _alive(pid), f"process {pid} left behind"
    finally:
        if process.poll() is None:  # a failed test: tritonserver has a process group of its own, killed first
            for pid in _descendants(process.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if os.getpgid(pid) == pid:
                        os.killpg(pid, signal.SIGKILL)
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    assert_group_gone(process.pid)
    # a clean stop: vLLM's AsyncLLM used to print a TypeError traceback from __del__ at every stop
    output = (tmp_path / "serve.log").read_text(errors="replace")
    assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]


def _descendants(pid: int) -> list[int]:
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
