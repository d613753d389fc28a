"""The tiny demo pipelines can tell their inputs apart: another prompt, negative prompt, guidance
scale or step count moves each family's image far past the parity tests' tolerance (1 level of
255), so a parity test fails when a route encodes or guides a request wrongly. (FLUX.2 [dev] and
FLUX.1 [dev] run no negative pass: their DiT reads the scale, so 1 is a guidance like any other.)
FLUX.1's pooled CLIP vector moves the image on its own too (test_diffusion_families.py).
Qwen-Image-Edit's image moves it too: another input image. Wan's video: another frame count too
(its first frames compared); Wan 2.2 TI2V's: a first image too (against the text-only video)."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.support.images import picture
from tests.support.pipelines import NO_GUIDANCE, NO_NEGATIVE, levels_apart, reference

# The parity tests' request (tests/integration/test_model_families.py)
BASE = {"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 4.0, "num_inference_steps": 2,
        "height": 32, "width": 32, "seed": 7}
MIN_LEVELS = 10
EDITS = {"qwen-image-edit"}  # the families that edit an input image: every call gives one
VIDEOS = {"wan", "wan2.2"}  # the families that make videos: every call gives a frame count
FIRST_FRAMES = {"wan2.2"}  # the video families that take a first image: another one moves the frames too


def changes(family: str) -> dict[str, dict]:
    negatives = {} if family in NO_NEGATIVE else {"negative prompt": {"negative_prompt": "sharp"},
                                                  "empty negative prompt": {"negative_prompt": ""}}
    return {
        "prompt": {"prompt": "a watercolor lighthouse"},
        **negatives,
        "guidance scale": {"guidance_scale": 1.5},
        "guidance off": {"guidance_scale": NO_GUIDANCE[family]},
        "step count": {"num_inference_steps": 3},
        **({"input image": {"image": Image.fromarray(picture(2))}} if family in EDITS else {}),
        **({"first image": {"image": Image.fromarray(picture(2))}} if family in FIRST_FRAMES else {}),
        **({"frame count": {"num_frames": 9}} if family in VIDEOS else {}),
    }


@pytest.mark.parametrize("family", ["sd", "qwen-image", "z-image", "flux2-klein", "flux2-dev", "flux1-dev",
                                    "qwen-image-edit", "wan", "wan2.2"])
def test_each_input_moves_the_image_far_past_the_parity_tolerance(family):
    given = BASE | ({"image": Image.fromarray(picture(1))} if family in EDITS else {}) | \
        ({"num_frames": 5} if family in VIDEOS else {})
    base = reference(family, **given)
    moved = {name: levels_apart(base, reference(family, **(given | change))[: len(base)])
             for name, change in changes(family).items()}
    print(f"{family}: levels of 255 each change moved the image by: {moved}")  # pytest -s shows them
    assert all(levels >= MIN_LEVELS for levels in moved.values()), moved
