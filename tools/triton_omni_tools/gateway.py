"""``serve``'s OpenAI-compatible gateway: its own process beside tritonserver.

It outlives a restart of tritonserver (it answers 503 meanwhile and its gRPC
client reconnects), so the launcher starts it once the server is first
ready and stops it last. The chat templates it needs are the tokenizers of
the text-generation models in the repositories, found here because only the
tools may resolve a ``demo:`` model to its folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from triton_omni_tools.reaper import Leftovers, Reaper, kill_group
from triton_omni_tools.repository import load_config

logger = logging.getLogger(__name__)
API_KEY_ENV = "TRITON_OMNI_API_KEY"  # the gateway's own variable (triton_omni_gateway.app)
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # its workers' shared metrics folder (triton_omni_gateway.__main__)
TEXT_BACKEND = "omni_ar"
SPEECH_BACKEND = "omni_speech"


def text_model_tokenizers(repositories: list[Path]) -> dict[str, str]:
    """Each text-generation model (``omni_ar``, not in encode mode) and speech model (``omni_speech``)
    -> where its tokenizer is."""
    from triton_omni.demo_models import resolve_model

    found = {}
    for repository in repositories:
        for config_path in sorted(repository.glob("*/config.pbtxt")):
            config = load_config(config_path)
            parameters = {key: value.string_value for key, value in config.parameters.items()}
            speaks = config.backend == SPEECH_BACKEND  # /v1/audio/speech reads its tokenizer
            if (speaks or (config.backend == TEXT_BACKEND and parameters.get("mode", "generate") == "generate")) \
                    and "model" in parameters:
                found[config.name or config_path.parent.name] = resolve_model(parameters["model"])
    return found


def default_workers() -> int:
    """One gateway process per four cores, at most four: a streamed token costs the gateway's event
    loop far more than it costs the engine, and a small host keeps its cores for the models."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class Gateway:
    def __init__(self, port: int, bind: str, grpc_url: str, tokenizers: dict[str, str],
                 api_key: str | None = None, workers: int = 1, startup_timeout_s: float = 60.0,
                 max_video_jobs: int | None = None):
        self.url = f"{bind}:{port}"
        # In the environment, not on the command line, where `ps` would show it.
        self.env = os.environ | ({API_KEY_ENV: api_key} if api_key else {})
        self.command = [sys.executable, "-m", "triton_omni_gateway", f"--triton-url={grpc_url}", f"--host={bind}",
                        f"--port={port}", f"--workers={workers}",
                        *(f"--tokenizer={model}={path}" for model, path in tokenizers.items()),
                        *([f"--max-video-jobs={max_video_jobs}"] if max_video_jobs else [])]
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.reaper: Reaper | None = None
        self.workers = workers
        self.metrics_dir: str | None = None

    def start(self) -> Gateway:
        # Its workers in its group, which dies with this process however it ends, and with it the
        # workers' metrics folder, made here for that reason (reaper.py).
        self.reaper = Reaper()
        try:
            env = self.env
            if self.workers > 1:
                self.metrics_dir = tempfile.mkdtemp(prefix="triton-omni-gateway-metrics-")
                env = env | {METRICS_DIR_ENV: self.metrics_dir}
            self.process = subprocess.Popen(self.command, env=env, start_new_session=True)
            self.reaper.watch(Leftovers(self.process.pid, paths=[self.metrics_dir] if self.metrics_dir else []))
            deadline = time.monotonic() + self.startup_timeout_s
            while not self._listening():
                if self.process.poll() is not None:
                    raise RuntimeError(f"the OpenAI gateway exited with code {self.process.returncode} at startup")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the OpenAI gateway did not listen on {self.url} in {self.startup_timeout_s} s")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def _listening(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.url}/health", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # 503: listening, Triton not ready
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM (uvicorn's graceful shutdown, workers included), then SIGKILL for whatever of its group is left."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(10)
                except subprocess.TimeoutExpired:
                    logger.warning("the OpenAI gateway did not stop in 10 s; killing it")
            kill_group(self.process.pid)
            self.process.wait()
        if self.metrics_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        if self.reaper is not None:
            self.reaper.close()
