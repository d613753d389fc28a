"""Qwen-Image-Edit served end to end (`omni-triton serve --demo qwen-image-edit`): every route a
user edits an image by gives `QwenImageEditPipeline`'s own image for the same image, prompt,
negative prompt and seed, within 1/255: `diffusion` with the prompt, `diffusion` with
`ar_encoder`'s embeddings (read with the image), the `text_to_image` ensemble (the image goes to
both stages), the `omni` scheduler, `omni-triton generate-image --image`, and OpenAI's
`/v1/images/edits` through the `openai` SDK. Another image or prompt moves the tiny demo's edit
far past that tolerance (test_demo_sensitivity.py). An edit without its image is refused naming
`images` on every route, and the server serves on."""

from __future__ import annotations

import base64
import functools
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from triton_omni_client import OmniClient, OmniError
from triton_omni_tools.launcher import ServerOptions, free_port

from tests.support.images import png
from tests.support.pipelines import ABSENT, levels_apart, reference
from tests.support.server import serving_openai

PROMPT = "make the fox blue"
OPTIONS = {"num_inference_steps": 2, "height": 32, "width": 32, "seed": 7, "guidance_scale": 4.0}
IMAGE = png(1)


@pytest.fixture(scope="module")
def edit_server(tmp_path_factory):
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            model_control_mode="explicit", demo="qwen-image-edit",
                            load_models=["ar_encoder", "diffusion", "text_to_image", "omni"],
                            log_file=Path(tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    with serving_openai(options) as server:
        yield server


@functools.cache
def expected(negative=ABSENT) -> np.ndarray:
    options = {key: value for key, value in OPTIONS.items() if key != "guidance_scale"}
    return reference("qwen-image-edit", PROMPT, negative, guidance_scale=OPTIONS["guidance_scale"],
                     image=Image.open(io.BytesIO(IMAGE)), **options)


def assert_close(image: np.ndarray, reference_image: np.ndarray) -> None:
    assert image.shape == reference_image.shape
    assert levels_apart(image, reference_image) <= 1


def test_every_route_edits_as_the_pipeline(edit_server, tmp_path):
    """True CFG with a negative prompt on every route (absent: none, on the ensemble)."""
    guided = expected("blurry")
    client = OmniClient(edit_server.grpc_url)
    assert_close(client.edit_image(PROMPT, [IMAGE], negative_prompt="blurry", **OPTIONS), guided)
    conditioning = client.encode_conditioning(PROMPT, "blurry", images=[IMAGE])
    assert_close(client.edit_image(None, [IMAGE], **conditioning, **OPTIONS), guided)
    assert_close(client.edit_image(PROMPT, [IMAGE], model="text_to_image", negative_prompt="blurry", **OPTIONS),
                 guided)
    [by_omni] = [event.image[0] for event in client.generate(PROMPT, modalities=["image"], images=[IMAGE],
                                                             negative_prompt="blurry", **OPTIONS)
                 if event.image is not None]
    assert_close(by_omni, guided)
    assert_close(client.edit_image(PROMPT, [IMAGE], model="text_to_image", **OPTIONS), expected())
    source, out = tmp_path / "in.png", tmp_path / "out.png"
    source.write_bytes(IMAGE)
    subprocess.run([str(Path(sys.executable).parent / "omni-triton"), "generate-image", PROMPT, "--image",
                    str(source), "--negative-prompt", "blurry", "--out", str(out), "--url", edit_server.grpc_url,
                    "--steps", "2", "--seed", "7", "--guidance", "4", "--height", "32", "--width", "32"], check=True)
    with Image.open(out) as written:
        assert_close(np.asarray(written), guided)


@pytest.mark.parametrize("model", ["diffusion", "text_to_image", "omni"])
def test_openai_images_edit_gives_the_pipelines_edit(edit_server, model):
    response = edit_server.openai.images.edit(
        model=model, image=("in.png", IMAGE, "image/png"), prompt=PROMPT, size="32x32",
        extra_body={"seed": OPTIONS["seed"], "num_inference_steps": 2, "guidance_scale": 4.0,
                    "negative_prompt": "blurry"})
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))).convert("RGB"))
    assert_close(image, expected("blurry"))


def test_an_edit_without_its_image_is_refused_by_name_on_every_route(edit_server):
    client = OmniClient(edit_server.grpc_url)
    for model in ("diffusion", "text_to_image"):
        with pytest.raises(OmniError, match="images") as caught:
            client.generate_image(PROMPT, model=model, **OPTIONS)
        assert caught.value.status == "INVALID_ARG"
    with pytest.raises(OmniError, match="images") as caught:
        list(client.generate(PROMPT, modalities=["image"], **OPTIONS))
    assert caught.value.status == "INVALID_ARG"
    with pytest.raises(openai.BadRequestError) as refused:
        edit_server.openai.images.generate(model="diffusion", prompt=PROMPT, size="32x32")
    assert "images" in str(refused.value)
    with pytest.raises(OmniError, match="images") as caught:  # two images: the pipeline edits one
        client.edit_image(PROMPT, [IMAGE, IMAGE], **OPTIONS)
    assert client.edit_image(PROMPT, [IMAGE], **OPTIONS).shape == (32, 32, 3)  # served on
