"""Triton's own ``model_warmup`` on ``diffusion`` (docs/models.md, "Warm-up at load"): the samples run
before the model is ready, a batch of them as one step batch, so that a compiled DiT's first shapes
are compiled (and its CUDA graphs captured) before the first user's request, not during it. Zero
embeddings and option values from the ``warmup`` folder's files, as the docs write them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_omni_tools.launcher import PROJECT_ROOT, ServerOptions, TritonServer, free_port
from triton_omni_tools.repository import copy_model

from tests.support.server import metric_value

WIDTH = 128  # demo:tiny-sd's text encoder width
# (name, rows, steps): one request alone, then two together
SAMPLES = [("one", 1, 2), ("two", 2, 3)]


def warmup_sample(name: str, rows: int, steps_file: str) -> str:
    return f"""{{
  name: "{name}"
  batch_size: {rows}
  inputs {{ key: "prompt_embeds" value {{ data_type: TYPE_FP32 dims: [8, {WIDTH}] zero_data: true }} }}
  inputs {{ key: "num_inference_steps" value {{ data_type: TYPE_INT32 dims: [1] input_data_file: "{steps_file}" }} }}
  inputs {{ key: "height" value {{ data_type: TYPE_INT32 dims: [1] input_data_file: "size" }} }}
  inputs {{ key: "width" value {{ data_type: TYPE_INT32 dims: [1] input_data_file: "size" }} }}
}}"""


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    repository = tmp_path_factory.mktemp("warmup")
    copy_model(PROJECT_ROOT / "model_repository", "diffusion", repository, parameters={})
    model = repository / "diffusion"
    (model / "warmup").mkdir()
    np.array([32], np.int32).tofile(model / "warmup" / "size")  # raw little-endian values, one row's
    for name, _, steps in SAMPLES:
        np.array([steps], np.int32).tofile(model / "warmup" / f"steps_{name}")
    samples = ",\n".join(warmup_sample(name, rows, f"steps_{name}") for name, rows, _ in SAMPLES)
    config = model / "config.pbtxt"
    config.write_text(config.read_text() + f"\nmodel_warmup [\n{samples}\n]\n")
    with TritonServer(ServerOptions(model_repositories=[repository], http_port=free_port(), grpc_port=free_port(),
                                    metrics_port=free_port(),
                                    log_file=tmp_path_factory.mktemp("logs") / "tritonserver.log")) as server:
        yield server


def test_the_warmup_samples_run_before_the_model_is_ready(warmed: TritonServer):
    """Ready, and before any request of ours the stage has run every sample's rows and steps."""
    with grpcclient.InferenceServerClient(warmed.grpc_url) as client:
        assert client.is_model_ready("diffusion")
    assert metric_value(warmed, "omni_diffusion_steps_total", model="diffusion") == sum(r * s for _, r, s in SAMPLES)
    assert metric_value(warmed, "nv_inference_count", model="diffusion") == sum(r for _, r, _ in SAMPLES)
    # the denoising steps' batch sizes: each sample's rows stepped together, never one at a time
    assert metric_value(warmed, "omni_diffusion_batch_size_count", model="diffusion") == sum(s for _, _, s in SAMPLES)
    assert metric_value(warmed, "omni_diffusion_batch_size_sum", model="diffusion") == sum(r * s for _, r, s in SAMPLES)
    assert "failed to run warmup" not in Path(warmed.options.log_file).read_text(errors="replace")
