"""CFG parallel served (`parallel: cfg` on the CPU, two processes over gloo):
the Python backend's stub is rank 0 and starts its worker, which runs every
negative prompts' pass; the image equals Qwen-Image's own diffusers pipeline
within 1/255 per pixel, a request with a step cache (its negatives' cache kept
in the worker) and one without guidance are served, and the worker leaves with
the server. tests/gpu serves it over two GPUs (`--place diffusion=cfg:0,1`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from triton_omni.demo_models import resolve_model
from triton_omni.diffusion.steps import to_pixels
from triton_omni_client import OmniClient

from tests.support.server import diffusion_alone, process_group

MODEL = "demo:tiny-qwen-image"
OPTIONS = {"num_inference_steps": 3, "height": 32, "width": 32, "guidance_scale": 4.0, "seed": 11}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from diffusion_alone(tmp_path_factory, {"model": MODEL, "parallel": "cfg"})  # its worker leaves with it


def pipelines_image(**overrides) -> np.ndarray:
    options = OPTIONS | overrides
    pipeline = DiffusionPipeline.from_pretrained(resolve_model(MODEL))
    with torch.inference_mode():
        return to_pixels(pipeline(
            prompt="a red fox", negative_prompt="blurry", num_inference_steps=options["num_inference_steps"],
            height=options["height"], width=options["width"], true_cfg_scale=options["guidance_scale"],
            output_type="pt", generator=torch.Generator().manual_seed(options["seed"])).images)[0].numpy()


def test_the_stub_started_its_worker(server):
    assert len(process_group(server.process.pid)) >= 3  # the server, the stub (rank 0), the worker (rank 1)
    assert "CFG parallel: the negatives' pass on cpu, in a worker process" in \
        Path(server.options.log_file).read_text()


def test_the_image_is_the_pipelines(server):
    image = OmniClient(server.grpc_url).generate_image(prompt="a red fox", negative_prompt="blurry", **OPTIONS)
    expected = pipelines_image()
    assert image.shape == expected.shape
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1


def test_a_cached_request_and_an_unguided_one(server):
    client = OmniClient(server.grpc_url)
    cached = client.generate_image(prompt="a red fox", negative_prompt="blurry", step_cache="first_block:0.4",
                                   **OPTIONS)
    unguided = client.generate_image(prompt="a red fox", **OPTIONS | {"guidance_scale": 1.0})
    assert cached.shape == unguided.shape == (32, 32, 3)
    assert np.abs(unguided.astype(int) - pipelines_image(guidance_scale=1.0).astype(int)).max() <= 1
