"""Input images: FLUX.2's reference images give the pipeline's own image (called with the same
image, prompt and seed), through request and step batching, alone and in company; another
image moves the image far; and every bad image is a typed error naming its field, decided
before its pixels are decoded where the header already says no."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from PIL import Image
from triton_omni.diffusion.runner import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.errors import RequestValidationError
from triton_omni.images import ImageLimits, decode_images

from tests.support.images import encoded, picture
from tests.support.pipelines import call

SIZE, STEPS = 32, 2
BASE = {"prompt": "a red fox", "guidance_scale": 4.0, "seed": 3, "num_inference_steps": STEPS, "height": SIZE,
        "width": SIZE}


def levels(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.int() - b.int()).abs().max())


@pytest.mark.parametrize("batching", ["request", "step"])
@pytest.mark.parametrize("model", ["demo:tiny-flux2-klein", "demo:tiny-flux2-dev"])
def test_reference_images_give_the_pipelines_image(model, batching):
    runner = DiffusionRunner(DiffusionRunnerConfig(model, batching=batching, batch_size=4, exact_batching=False))
    try:
        first, second = Image.fromarray(picture(1)), Image.fromarray(picture(2, 64, 96))
        expected = call(runner.pipeline, "a red fox", guidance_scale=4.0, seed=3, num_inference_steps=STEPS,
                        height=SIZE, width=SIZE, image=[first, second])[0]
        # alone, as files; then in company: another image, no image, the same images as pixels (one only)
        [alone] = runner.run([runner.parse(BASE | {"images": [encoded(first), encoded(second)]})])
        assert levels(alone, expected) == 0
        company = runner.run([runner.parse(values) for values in (
            BASE | {"images": [encoded(first), encoded(second)]}, BASE | {"images": [encoded(picture(3))]},
            BASE, BASE | {"seed": 4, "images": [encoded(first), encoded(second)]},
            BASE | {"image": torch.from_numpy(picture(1))})])
        assert levels(company[0], expected) <= 1
        single = call(runner.pipeline, "a red fox", guidance_scale=4.0, seed=3, num_inference_steps=STEPS,
                      height=SIZE, width=SIZE, image=[first])[0]
        assert levels(company[4], single) <= 1  # pixels are the same image as its PNG
        if batching == "step":  # the same references again (alone's, then the fourth's) were encoded once
            assert runner.steps.adapter.input_latents.hits == 2
            seed_4 = call(runner.pipeline, "a red fox", guidance_scale=4.0, seed=4, num_inference_steps=STEPS,
                          height=SIZE, width=SIZE, image=[first, second])[0]
            assert levels(company[3], seed_4) <= 1
        # the image matters: another image, or none, moves it far past the tolerance
        assert levels(company[0], company[1]) >= 10 and levels(company[0], company[2]) >= 10
    finally:
        runner.close()


def test_without_a_size_the_output_takes_the_last_images_as_the_pipeline_does():
    runner = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-flux2-klein", batching="step"))
    try:
        values = {"prompt": "a red fox", "images": [encoded(picture(1)), encoded(picture(2, 72, 64))]}
        request = runner.parse(values)
        assert (request.height, request.width) == (72, 64)
        assert runner.parse(values | {"width": 32}).width == 32
        with pytest.raises(RequestValidationError, match=r"`images\[0\]`: Image too small"):
            runner.parse({"prompt": "a red fox", "images": [encoded(picture(1, 40, 40))]})
        with pytest.raises(RequestValidationError, match=r"`image`: Aspect ratio too extreme"):
            runner.parse({"prompt": "a red fox", "image": torch.from_numpy(picture(1, 64, 640))})
    finally:
        runner.close()


LIMITS = ImageLimits(max_images=4, max_image_bytes=1 << 20, max_image_pixels=4096 * 4096)


def cmyk_jpeg() -> bytes:
    return encoded(Image.fromarray(picture(1)).convert("CMYK"), "JPEG")


def animated_png() -> bytes:
    frames = [Image.fromarray(picture(seed)) for seed in (1, 2)]
    return encoded(frames[0], "PNG", save_all=True, append_images=frames[1:])


def sixteen_bit_png() -> bytes:
    return encoded(Image.fromarray(np.full((64, 64), 40000, np.uint16)))


def huge_png(side: int) -> bytes:
    """A 1-bit picture of side x side pixels: small to send, huge to decode."""
    return encoded(Image.new("1", (side, side)))


BAD = {  # name -> (image, images, the field named, the reason's words)
    "corrupt PNG": (None, [b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 8], "images[0]", "not an image file"),
    "truncated JPEG": (None, [(lambda data: data[: len(data) // 2])(encoded(picture(1), "JPEG"))], "images[0]",
                       "could not be decoded"),
    "zero bytes": (None, [b""], "images[0]", "empty"),
    "no file at all": (None, [], "images", "holds no image"),
    "a text file": (None, [b"hello, this is not an image\n" * 4], "images[0]", "not an image file"),
    "a PDF": (None, [b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\n"], "images[0]", "not an image file"),
    "a GIF": (None, [encoded(picture(1), "GIF")], "images[0]", "format must be one of"),
    "a BMP": (None, [encoded(picture(1), "BMP")], "images[0]", "format must be one of"),
    "a TIFF": (None, [encoded(picture(1), "TIFF")], "images[0]", "format must be one of"),
    "an animated PNG": (None, [animated_png()], "images[0]", "animation"),
    "a 16-bit PNG": (None, [sixteen_bit_png()], "images[0]", "8-bit channels"),
    "25 megapixels (past the limit: Pillow only warns)": (None, [huge_png(5_000)], "images[0]",
                                                          "more than 16777216 pixels"),
    "100 megapixels (a decompression bomb to Pillow)": (None, [huge_png(10_000)], "images[0]",
                                                        "more than 16777216 pixels"),
    "over the byte limit": (None, [encoded(np.random.default_rng(0).integers(0, 255, (800, 800, 3), np.uint8))],
                            "images[0]", "larger than 1048576 bytes"),
    "more images than the model takes": (None, [encoded(picture(seed)) for seed in range(5)], "images",
                                         "at most 4 images"),
    "the second of two bad": (None, [encoded(picture(1)), b"nope"], "images[1]", "not an image file"),
    "pixels and files at once": (torch.from_numpy(picture(1)), [encoded(picture(1))], "image", "not both"),
    "float pixels": (torch.rand(64, 64, 3), None, "image", "UINT8"),
    "four channels": (torch.zeros(64, 64, 4, dtype=torch.uint8), None, "image", "RGB"),
    "a flat array": (torch.zeros(64 * 64 * 3, dtype=torch.uint8), None, "image", "RGB"),
    "zero-sized pixels": (torch.zeros(0, 64, 3, dtype=torch.uint8), None, "image", "at least 1 pixels"),
    "100 megapixels of pixels": (torch.zeros(1, 1, 3, dtype=torch.uint8).expand(10_000, 10_000, 3), None, "image",
                                 "more than 16777216 pixels"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_image_is_refused_naming_its_field(case):
    pixels, files, field, words = BAD[case]
    with pytest.raises(RequestValidationError) as caught:
        decode_images(pixels, files, LIMITS)
    assert caught.value.parameter == field and words in str(caught.value), str(caught.value)


def test_a_model_that_takes_no_image_says_so():
    for pixels, files in ((torch.from_numpy(picture(1)), None), (None, [encoded(picture(1))])):
        with pytest.raises(RequestValidationError, match="this model takes no input image"):
            decode_images(pixels, files, ImageLimits())


@pytest.mark.parametrize("make", [cmyk_jpeg, lambda: encoded(Image.fromarray(picture(1)).convert("RGBA")),
                                  lambda: encoded(Image.fromarray(picture(1)).convert("P")),
                                  lambda: encoded(Image.fromarray(picture(1)).convert("L")),
                                  lambda: encoded(picture(1), "WEBP"), lambda: encoded(picture(1), "JPEG")],
                         ids=["CMYK JPEG", "RGBA PNG", "palette PNG", "grayscale PNG", "WebP", "JPEG"])
def test_what_a_diffusers_user_converts_is_converted_to_rgb(make):
    [image] = decode_images(None, [make()], LIMITS)
    assert image.mode == "RGB" and image.size == (80, 64)


def test_a_cached_request_with_reference_images_takes_its_decisions_alone_in_company():
    """The step cache on reference images: a cached request's skips and image are its own, alone or
    beside others (with other images, none, uncached)."""
    runner = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-flux2-klein", batching="step", batch_size=8,
                                                   exact_batching=False))
    cached = BASE | {"num_inference_steps": 10, "step_cache": "first_block:0.8", "images": [encoded(picture(1))]}

    def submit(values: dict, counts: list):
        return runner.submit(runner.parse(values), on_cached=lambda c, s: counts.append((c, s)))

    try:
        alone_counts: list = []
        alone = submit(cached, alone_counts).result()
        company = [cached, BASE | {"num_inference_steps": 10, "images": [encoded(picture(2))]},
                   BASE | {"num_inference_steps": 10, "seed": 9}]
        counts: list = [[] for _ in company]
        images = [future.result() for future in [submit(v, counts[i]) for i, v in enumerate(company)]]
    finally:
        runner.close()
    assert alone_counts and 0 < alone_counts[0][1] < 10, alone_counts  # some steps skipped, not all
    assert counts[0] == alone_counts and levels(images[0], alone) <= 1


def test_sequence_parallel_refuses_input_images_by_name(monkeypatch):
    runner = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-flux2-klein", batching="request"))
    # as a runner with `parallel: sp` has one
    monkeypatch.setattr(runner, "sequence_parallel", types.SimpleNamespace(devices=["cpu", "cpu"]))
    with pytest.raises(RequestValidationError, match="`images`: not with sequence parallel"):
        runner.parse(BASE | {"images": [encoded(picture(1))]})
