"""The LLM-conditioned DiT families served end to end (`omni-triton serve
--demo qwen-image|z-image`): `diffusion` with a prompt, and `text_to_image`
(`ar_encoder` running the family's text recipe, then `diffusion`), each
image equal to the family's own diffusers pipeline with the same inputs and
seed, within 1/255 per pixel (the server's CPU threads are not the test's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from triton_omni.demo_models import resolve_model
from triton_omni.diffusion.steps import to_pixels
from triton_omni_client import OmniClient, OmniError
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

from tests.support.server import metric_value, text_to_image

FAMILIES = {"qwen-image": "demo:tiny-qwen-image", "z-image": "demo:tiny-z-image"}
OPTIONS = {"num_inference_steps": 2, "height": 32, "width": 32, "guidance_scale": 3.0, "seed": 7}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(request, tmp_path_factory):
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            model_control_mode="explicit",
                            load_models=["ar", "ar_encoder", "diffusion", "text_to_image", "omni"],
                            demo=request.param, log_file=Path(tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    with TritonServer(options) as server:
        yield request.param, server


def reference(family: str, prompt: str, negative: str | None) -> np.ndarray:
    pipeline = DiffusionPipeline.from_pretrained(resolve_model(FAMILIES[family]))
    guidance = {"true_cfg_scale" if family == "qwen-image" else "guidance_scale": OPTIONS["guidance_scale"]}
    with torch.inference_mode():
        images = pipeline(prompt=prompt, negative_prompt=negative, num_inference_steps=OPTIONS["num_inference_steps"],
                          height=OPTIONS["height"], width=OPTIONS["width"], output_type="pt",
                          generator=torch.Generator().manual_seed(OPTIONS["seed"]), **guidance).images
    return to_pixels(images)[0].numpy()


def assert_close(image: np.ndarray, expected: np.ndarray) -> None:
    assert image.shape == expected.shape
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1


def test_a_prompt_to_diffusion_gives_the_pipelines_image(family_server):
    family, server = family_server
    image = OmniClient(server.grpc_url).generate_image(prompt="a red fox", negative_prompt="blurry", **OPTIONS)
    assert_close(image, reference(family, "a red fox", "blurry"))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_text_to_image_gives_the_pipelines_image(family_server, protocol):
    """ar_encoder's recipe output conditions diffusion as the pipeline's own encoding would."""
    family, server = family_server
    url = server.grpc_url if protocol == "grpc" else server.http_url
    image = text_to_image(url, protocol, "a watercolor lighthouse", "blurry", **OPTIONS)
    assert_close(image, reference(family, "a watercolor lighthouse", "blurry"))


def test_omni_routes_work_with_the_family(family_server):
    """omni's image route encodes through ar_encoder and diffuses as text_to_image does; prompt
    enhancement (ar rewrites the prompt first) and the hybrid route end in an image too."""
    family, server = family_server
    client = OmniClient(server.grpc_url)

    def image_of(**kwargs) -> np.ndarray:
        images = [event.image for event in client.generate("a red fox", **kwargs) if event.image is not None]
        assert len(images) == 1 and images[0].shape[0] == 1
        return images[0][0]

    plain = image_of(modalities=["image"], negative_prompt="blurry", **OPTIONS)
    assert_close(plain, reference(family, "a red fox", "blurry"))
    assert image_of(modalities=["image"], enhance_prompt=True, max_tokens=8, **OPTIONS).shape == plain.shape
    assert image_of(modalities=["text", "image"], max_tokens=4, **OPTIONS).shape == plain.shape


def test_a_size_off_the_patch_grid_is_refused_by_name(family_server):
    _, server = family_server
    with pytest.raises(OmniError, match="height") as caught:
        OmniClient(server.grpc_url).generate_image(prompt="a red fox", **(OPTIONS | {"height": 34}))
    assert caught.value.status == "INVALID_ARG"


STEP_CACHE = {"qwen-image": "first_block:0.4", "z-image": "first_block:0.8"}  # skip some of 10 steps (tiny DiTs)


def test_a_request_chooses_its_step_cache_on_every_route(family_server):
    """`step_cache` reaches diffusion straight, through text_to_image's ensemble and through omni;
    the steps each request computed and skipped are counted per model."""
    family, server = family_server
    options = OPTIONS | {"num_inference_steps": 10}

    def steps(outcome: str) -> float:
        return metric_value(server, "omni_diffusion_cached_steps_total", model="diffusion", outcome=outcome)

    before = steps("computed"), steps("skipped")
    client = OmniClient(server.grpc_url)
    cached = client.generate_image(prompt="a red fox", negative_prompt="blurry", step_cache=STEP_CACHE[family],
                                   **options)
    plain = client.generate_image(prompt="a red fox", negative_prompt="blurry", step_cache="off", **options)
    computed, skipped = steps("computed") - before[0], steps("skipped") - before[1]
    assert computed + skipped == 10 and skipped > 0, (computed, skipped)
    assert metric_value(server, "omni_diffusion_skipped_step_ratio_count", model="diffusion") >= 1
    assert np.abs(cached.astype(int) - plain.astype(int)).max() > 0  # skipped steps change the image a little
    ensemble = text_to_image(server.grpc_url, "grpc", "a red fox", "blurry", step_cache=STEP_CACHE[family],
                             **options)
    assert steps("computed") + steps("skipped") - sum(before) == 20 and ensemble.shape == cached.shape
    [event] = [e for e in client.generate("a red fox", modalities=["image"], negative_prompt="blurry",
                                          step_cache=STEP_CACHE[family], **options) if e.image is not None]
    assert steps("computed") + steps("skipped") - sum(before) == 30 and event.image[0].shape == cached.shape


@pytest.mark.parametrize("value", ["teacache", "first_block:2", "first_block:x"])
def test_a_malformed_step_cache_is_invalid_arg_naming_it(family_server, value):
    _, server = family_server
    with pytest.raises(OmniError) as error:
        OmniClient(server.grpc_url).generate_image(prompt="a red fox", step_cache=value, **OPTIONS)
    assert error.value.status == "INVALID_ARG" and "step_cache" in str(error.value)
    assert OmniClient(server.grpc_url).generate_image(prompt="a red fox", **OPTIONS).shape == (32, 32, 3)
