"""Each demo family's own diffusers pipeline, called the way its users call it: the reference
every served image is compared with."""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch
import triton_omni.families  # noqa: F401  (diffusers loads the tiny edit demo's processor from it, once imported)
from diffusers import DiffusionPipeline
from triton_omni.demo_models import resolve_model
from triton_omni.diffusion.steps import to_pixels

# `omni-triton serve --demo NAME` -> the tiny pipeline it serves
DEMO_PIPELINES = {"sd": "demo:tiny-sd", "qwen-image": "demo:tiny-qwen-image", "z-image": "demo:tiny-z-image",
                  "flux2-klein": "demo:tiny-flux2-klein", "flux2-dev": "demo:tiny-flux2-dev",
                  "flux1-dev": "demo:tiny-flux1-dev", "qwen-image-edit": "demo:tiny-qwen-image-edit",
                  "qwen-image-edit-plus": "demo:tiny-qwen-image-edit-plus", "wan": "demo:tiny-wan",
                  "wan2.2": "demo:tiny-wan2.2", "wan2.2-a14b": "demo:tiny-wan2.2-a14b"}
# The keyword each pipeline reads its guidance scale from (Qwen-Image: true CFG)
GUIDANCE_KEYWORD = {"sd": "guidance_scale", "qwen-image": "true_cfg_scale", "z-image": "guidance_scale",
                    "flux2-klein": "guidance_scale", "flux2-dev": "guidance_scale", "flux1-dev": "guidance_scale",
                    "qwen-image-edit": "true_cfg_scale", "qwen-image-edit-plus": "true_cfg_scale",
                    "wan": "guidance_scale", "wan2.2": "guidance_scale", "wan2.2-a14b": "guidance_scale"}
# What each family reads as "no guidance": SD, Qwen-Image and FLUX.2 [klein] guide above 1, Z-Image
# above 0 (FLUX.2 [dev] and FLUX.1 [dev] are guidance-distilled: the DiT reads any scale, 1 as much as 4)
NO_GUIDANCE = {"sd": 1.0, "qwen-image": 1.0, "z-image": 0.0, "flux2-klein": 1.0, "flux2-dev": 1.0, "flux1-dev": 1.0,
               "qwen-image-edit": 1.0, "qwen-image-edit-plus": 1.0, "wan": 1.0, "wan2.2": 1.0, "wan2.2-a14b": 1.0}
# The guidance-distilled families, whose pipeline runs no negative pass (FLUX.2 [dev] takes no negative
# prompt; FLUX.1's reads one only for true_cfg_scale, which is left at its default): a negative is ignored
NO_NEGATIVE = {"flux2-dev", "flux1-dev"}
ABSENT = object()  # a keyword left out of the call, as opposed to given as None


@functools.cache
def pipeline(family: str) -> DiffusionPipeline:
    loaded = DiffusionPipeline.from_pretrained(resolve_model(DEMO_PIPELINES[family]))
    loaded.set_progress_bar_config(disable=True)
    return loaded


def reference(family: str, prompt: str, negative_prompt=ABSENT, *, guidance_scale: float, num_inference_steps: int,
              height: int, width: int, seed: int, **inputs) -> np.ndarray:
    """The pipeline's image ``[H, W, 3]`` uint8 (a video's frames: ``[F, H, W, 3]``) for these
    arguments; ``negative_prompt`` left out of the call when ``ABSENT``; ``inputs``: more of the
    call's arguments (an edit's ``image``, a video's ``num_frames``)."""
    return call(pipeline(family), prompt, negative_prompt, guidance_keyword=GUIDANCE_KEYWORD[family],
                guidance_scale=guidance_scale, num_inference_steps=num_inference_steps, height=height, width=width,
                seed=seed, **inputs)[0].numpy()


def call(pipe: DiffusionPipeline, prompt: str, negative_prompt=ABSENT, *, guidance_keyword: str = "guidance_scale",
         guidance_scale: float, seed: int, **kwargs) -> torch.Tensor:
    """``pipe``'s own call, as its users write it, its images ``[N, H, W, 3]`` uint8 (a video
    pipeline's frames: ``[N, F, H, W, 3]``). A pipeline that
    takes no ``negative_prompt`` (FLUX.2 [klein]: its negative is "") gets a negative text the way
    its users give one: ``negative_prompt_embeds`` from its own ``encode_prompt``; one that takes no
    negative at all (FLUX.2 [dev], guidance-distilled) runs without it, as the server does."""
    if "image" in kwargs and "image" not in inspect.signature(pipe.__call__).parameters:
        pipe = image_pipeline(pipe)  # Wan 2.2 TI2V: its first image is read by the I2V pipeline's class
    parameters = inspect.signature(pipe.__call__).parameters
    if negative_prompt is ABSENT or negative_prompt is None:
        given = {}
    elif "negative_prompt" in parameters:
        given = {"negative_prompt": negative_prompt}
    elif "negative_prompt_embeds" in parameters:
        given = {"negative_prompt_embeds": pipe.encode_prompt(negative_prompt)[0]}
    else:
        given = {}
    with torch.inference_mode():
        output = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="pt",
                      **{guidance_keyword: guidance_scale}, **given, **kwargs)
    return to_pixels(output.frames if hasattr(output, "frames") else output.images)


def image_pipeline(pipe: DiffusionPipeline) -> DiffusionPipeline:
    """The pipeline its users call over ``pipe``'s components to give it a first image
    (``WanPipeline`` -> ``WanImageToVideoPipeline``: Wan 2.2 TI2V's model card does so)."""
    from diffusers import WanImageToVideoPipeline

    assert type(pipe).__name__ == "WanPipeline", type(pipe).__name__
    image_to_video = WanImageToVideoPipeline.from_pipe(pipe)
    image_to_video.set_progress_bar_config(disable=True)
    return image_to_video


def encoded(family: str, text: str) -> np.ndarray:
    """``text`` as the family's pipeline encodes it, ``[num_tokens, hidden]``, through its own
    ``encode_prompt`` (Stable Diffusion's: CLIP's last hidden state, padded to 77 tokens)."""
    assert family == "sd", "the DiT families' embeddings come from ar_encoder, whose recipe is theirs"
    with torch.inference_mode():
        return pipeline(family).encode_prompt(text, "cpu", 1, False)[0][0].numpy()


def levels_apart(image: np.ndarray, other: np.ndarray) -> int:
    """The largest difference of one channel of one pixel, in levels of 255."""
    assert image.shape == other.shape, (image.shape, other.shape)
    return int(np.abs(image.astype(int) - other.astype(int)).max())
