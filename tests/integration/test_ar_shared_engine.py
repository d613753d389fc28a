"""Two `ar` instances in front of one vLLM engine core (`instances_per_engine: 2`,
the variant `ar_shared`), on the real server with vLLM on the CPU: one engine
process serves both stubs, every request gets the text the model's own
engine gives it, and cancelling one stream leaves the others running.
`ar_encoder_shared` likewise encodes as `ar_encoder` does."""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from triton_omni.processes import identity
from triton_omni_client import OmniClient
from triton_omni_tools.supervisor import server_stubs

from tests.integration import test_ar_batching
from tests.integration.test_ar_batching import text
from tests.support.server import children, engine_cores

MODEL = "ar_shared"


def test_one_engine_core_serves_both_instances(server):
    stubs = [stub.pid for stub in server_stubs(server.process.pid) if stub.model == MODEL]
    assert len(stubs) == 2, stubs
    cores = set(engine_cores(server))
    engines = {stub: children(stub) & cores for stub in stubs}
    assert sorted(len(found) for found in engines.values()) == [0, 1], engines  # the first instance started it
    folder = Path(tempfile.gettempdir()) / f"triton-omni-engines-{identity(server.process.pid)}" / f"{MODEL}-cpu"
    sockets = sorted(path.name.split("-")[-1] for path in folder.glob("e0-*"))
    assert sockets == ["in0", "in1", "out0", "out1"]  # both frontends bound theirs


def test_concurrent_requests_get_the_text_of_the_models_own_engine(grpc_url):
    with ThreadPoolExecutor(8) as pool:
        shared = list(pool.map(lambda i: text(grpc_url, MODEL, i), range(8)))
    assert shared == [text(grpc_url, "ar", i) for i in range(8)]


@pytest.mark.parametrize("model", [MODEL])
def test_cancelling_a_stream_on_a_shared_engine_leaves_the_others_running(grpc_url, model):
    test_ar_batching.test_cancelling_one_stream_leaves_the_others_running(grpc_url, model)


def test_a_shared_encoder_engine_returns_the_embeddings_of_the_models_own(grpc_url):
    prompts = ["a red fox", "an astronaut rides a horse on the moon", "watercolor", "a robot reads a book"] * 2
    client = OmniClient(grpc_url, "grpc")
    with ThreadPoolExecutor(8) as pool:
        shared = list(pool.map(lambda p: client.encode(p, model="ar_encoder_shared"), prompts))
    for prompt, embeds in zip(prompts, shared, strict=True):
        np.testing.assert_allclose(embeds, client.encode(prompt, model="ar_encoder"), rtol=1e-4, atol=1e-4)
