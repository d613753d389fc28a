"""Sequence parallel served (`parallel: sp` on the CPU, two processes over
gloo): the Python backend's stub is rank 0 and starts its worker, the image
equals Qwen-Image's own diffusers pipeline within 1/255 per pixel, a request
for a step cache is INVALID_ARG naming it, and the worker leaves with the
server. tests/gpu serves it over two GPUs (`--place diffusion=sp:0,1`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from triton_omni.demo_models import resolve_model
from triton_omni.diffusion.steps import to_pixels
from triton_omni_client import OmniClient, OmniError

from tests.support.server import diffusion_alone, process_group

MODEL = "demo:tiny-qwen-image"
OPTIONS = {"num_inference_steps": 3, "height": 32, "width": 48, "guidance_scale": 4.0, "seed": 11}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from diffusion_alone(tmp_path_factory, {"model": MODEL, "parallel": "sp"})  # its worker leaves with it


def test_the_stub_started_its_worker(server):
    assert len(process_group(server.process.pid)) >= 3  # the server, the stub (rank 0), the worker (rank 1)


def test_the_image_is_the_pipelines(server):
    image = OmniClient(server.grpc_url).generate_image(prompt="a red fox", negative_prompt="blurry", **OPTIONS)
    pipeline = DiffusionPipeline.from_pretrained(resolve_model(MODEL))
    with torch.inference_mode():
        expected = to_pixels(pipeline(
            prompt="a red fox", negative_prompt="blurry", num_inference_steps=OPTIONS["num_inference_steps"],
            height=OPTIONS["height"], width=OPTIONS["width"], true_cfg_scale=OPTIONS["guidance_scale"],
            output_type="pt", generator=torch.Generator().manual_seed(OPTIONS["seed"])).images)[0].numpy()
    assert image.shape == expected.shape
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1
    assert "Sequence parallel (Ulysses): QwenImageTransformer2DModel over cpu, cpu" in \
        Path(server.options.log_file).read_text()


def test_a_step_cache_is_invalid_arg_naming_it_and_the_server_serves_on(server):
    client = OmniClient(server.grpc_url)
    with pytest.raises(OmniError) as error:
        client.generate_image(prompt="a red fox", step_cache="first_block:0.2", **OPTIONS)
    assert error.value.status == "INVALID_ARG" and "step_cache" in str(error.value)
    assert client.generate_image(prompt="a red fox", **OPTIONS).shape == (32, 48, 3)
