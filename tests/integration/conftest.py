"""One real tritonserver for the integration tests.

It serves the default repositories (``model_repository/`` with engine
``auto`` = vLLM here, and ``ensemble/``) plus a repository of variants:
``*_transformers`` copies of the AR configs, so both engines pass the same
behaviour tests (``ar_transformers`` with two LoRA adapters), ``diffusion_exact``, the diffusion stage with request
batching padded to a fixed size (the default is step batching),
``diffusion_pair``, two instances of the default ``diffusion``
(``diffusion_pair_small``: with room for two guided requests each),
``diffusion_stream``, the default ``diffusion`` decoupled (per-step progress),
``diffusion_bf16`` and ``ar_encoder_bf16`` (transformers), with ``embeds_dtype: bfloat16``,
``ar_shared`` and ``ar_encoder_shared``, two instances in front of one vLLM engine core, and
``omni_small_budget``, an ``omni`` whose admission budget is smaller than
one prompt's embeddings. The OpenAI-compatible gateway (``gateway``) runs
in front of it on demand. Helpers live in
``tests/support/server.py``.

It starts as soon as the tests are collected, beside the unit tests: they
run first and hold about one of a CI machine's two cores, and this server's
start (some twenty stubs importing torch, four vLLM engines) is then off the
integration tests' clock.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from triton_omni_tools.gateway import Gateway, text_model_tokenizers
from triton_omni_tools.launcher import (
    DEFAULT_REPOSITORIES,
    PROJECT_ROOT,
    ServerOptions,
    TritonServer,
    free_port,
    mapped_shared_memory,
)
from triton_omni_tools.repository import copy_model

from tests.support.server import assert_group_gone, process_group, require_alive

DEFAULT_REPOSITORY = PROJECT_ROOT / "model_repository"


# The demo models and the LoRA adapters, built in a process of their own: beside the unit tests, this
# process's torch (its GIL, its global seed and default dtype) is theirs.
BUILD = """
import sys
from pathlib import Path
from triton_omni.demo_models import build_all

from tests.support.loras import build_llm_lora

build_all()
loras = Path(sys.argv[1])
build_llm_lora(loras / "pirate", seed=1)
build_llm_lora(loras / "poet", seed=2, rank=4, targets=("q_proj", "v_proj"))
"""


def start_server(tmp_path_factory) -> tuple[TritonServer, Path]:
    """The server started and ready, and its log file."""
    variants = tmp_path_factory.mktemp("variants")
    # with two LoRA adapters in its folder, named by relative paths (test_ar_lora.py)
    lora_model = copy_model(DEFAULT_REPOSITORY, "ar", variants, "ar_transformers", parameters={
        "engine": "transformers", "lora_adapters": json.dumps({"pirate": "loras/pirate", "poet": "loras/poet"})})
    # its errors kept: beside the unit tests, pytest's capture would swallow them with their test's output
    # env given: this runs on a thread beside the unit tests, and a child exec'd with the process's
    # own environment reads it as it execs, while another thread may be setting a variable (which
    # frees the old array: run 43's "Bad address" for every integration test). A copy is private.
    built = subprocess.run([sys.executable, "-c", BUILD, str(lora_model / "loras")], cwd=PROJECT_ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    assert built.returncode == 0, f"building the demo models and LoRAs failed:\n{built.stderr[-4000:]}"
    copy_model(DEFAULT_REPOSITORY, "ar_encoder", variants, "ar_encoder_transformers",
               parameters={"engine": "transformers"})
    copy_model(DEFAULT_REPOSITORY, "diffusion", variants, "diffusion_exact",
               parameters={"batching": "request", "exact_batching": "true"}, max_queue_delay_us=20_000,
               preferred_batch_size=[])
    copy_model(DEFAULT_REPOSITORY, "diffusion", variants, "diffusion_stream", decoupled=True)
    # embeddings in bf16, half float32's bytes, from the encoder to the client and back (test_embeds_dtype.py)
    copy_model(DEFAULT_REPOSITORY, "diffusion", variants, "diffusion_bf16", parameters={"embeds_dtype": "bfloat16"})
    copy_model(DEFAULT_REPOSITORY, "ar_encoder", variants, "ar_encoder_bf16",
               parameters={"engine": "transformers", "embeds_dtype": "bfloat16"})
    copy_model(DEFAULT_REPOSITORY, "diffusion", variants, "diffusion_pair",
               instance_group=[{"kind": "KIND_CPU", "count": 2}])
    # full_hold_s: a full instance holds until one of its own long requests ends, however busy the cores
    copy_model(DEFAULT_REPOSITORY, "diffusion", variants, "diffusion_pair_small",
               parameters={"max_rows": "4", "full_hold_s": "600"}, instance_group=[{"kind": "KIND_CPU", "count": 2}])
    copy_model(DEFAULT_REPOSITORY, "ar", variants, "ar_shared", parameters={"instances_per_engine": "2"},
               instance_group=[{"kind": "KIND_CPU", "count": 2}])
    copy_model(DEFAULT_REPOSITORY, "ar_encoder", variants, "ar_encoder_shared",
               parameters={"instances_per_engine": "2"}, instance_group=[{"kind": "KIND_CPU", "count": 2}])
    copy_model(DEFAULT_REPOSITORY, "omni", variants, "omni_small_budget",
               parameters={"max_embeds_bytes_in_flight": "1000", "admission_policy": "reject"})
    log_file = Path(os.environ.get("TRITON_OMNI_TEST_LOG", tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    options = ServerOptions(
        model_repositories=[*DEFAULT_REPOSITORIES, variants],
        http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        log_file=log_file,
        # It starts beside the unit tests, sharing a CI machine's two cores: about 400 s here, and past
        # the default 600 s once on CI.
        startup_timeout_s=1200,
        # Its log's longest quiet spell while loading is under a minute even then: a load silent for
        # four is hung (once on CI, 17 minutes with one model never reported loaded), and is started again
        startup_stall_s=240,
    )
    return TritonServer(options).start(), log_file


_starting: dict[str, concurrent.futures.Future] = {}


def pytest_collection_finish(session):
    """Starts the server now if a test collected here will use it."""
    here = Path(__file__).parent
    if session.config.option.collectonly:
        return
    if any("server" in item.fixturenames and item.path.is_relative_to(here) for item in session.items):
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="integration-server")
        _starting["server"] = pool.submit(start_server, session.config._tmp_path_factory)
        pool.shutdown(wait=False)


def pytest_sessionfinish(session):
    """A server started for tests that never ran (a run cut short) is stopped all the same."""
    starting = _starting.pop("server", None)
    if starting is not None and starting.exception() is None:
        starting.result()[0].stop()


# Package scope: it stops when the integration tests end, before the reliability suite starts servers of its own.
@pytest.fixture(scope="package")
def server(tmp_path_factory):
    starting = _starting.pop("server", None)
    triton, log_file = starting.result() if starting is not None else start_server(tmp_path_factory)
    yield triton
    pgid = triton.process.pid
    group = process_group(pgid)
    assert len(group) > 1, "expected the server and its stubs in one process group"
    segments = mapped_shared_memory(group)
    assert any(segment.name.startswith("psm_") for segment in segments), "expected vLLM's shared memory"
    triton.stop()
    assert_group_gone(pgid)
    assert not [segment for segment in segments if segment.exists()], "shared memory left in /dev/shm"
    shutil.copy(log_file, PROJECT_ROOT / ".cache" / "last-test-server.log")
    # Every stub shuts down cleanly (metric families destroyed at interpreter exit crashed them).
    assert "Segfault encountered" not in log_file.read_text(errors="replace"), "a stub crashed at shutdown"


@pytest.fixture(scope="package")
def gateway(server) -> str:
    """The OpenAI-compatible gateway in front of the server, as `omni-triton serve` runs it: its base URL."""
    gateway = Gateway(free_port(), "127.0.0.1", server.grpc_url, text_model_tokenizers(server.repositories)).start()
    yield f"http://{gateway.url}"
    gateway.stop()


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
