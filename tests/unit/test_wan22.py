"""Wan 2.2 on tiny random-weight pipelines (CPU), each against its diffusers pipeline called the way
its users call it:

- TI2V-5B (``WanPipeline`` with ``expand_timesteps``): a prompt and a first image, against
  ``WanImageToVideoPipeline`` over the same components, with the negative prompt given, empty or
  left out (a prompt alone is in test_diffusion_families.py);
- T2V-A14B (two experts, ``boundary_ratio``): served equal to its pipeline, and each expert runs
  its own part of the schedule (the same request with one expert for both parts is far from it);
- I2V-A14B (``WanImageToVideoPipeline``, two experts): a first image required, named when missing.

Request batching (the pipeline's own call) is bit-exact; step batching within 1 level of 255."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline, WanPipeline
from diffusers.hooks import FirstBlockCacheConfig
from PIL import Image
from triton_omni.demo_models import resolve_model
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion.steps import to_pixels
from triton_omni.errors import RequestValidationError

from tests.support.images import picture, png
from tests.support.pipelines import ABSENT, call, image_pipeline

MODELS = {"ti2v": "demo:tiny-wan2.2", "t2v_a14b": "demo:tiny-wan2.2-a14b", "i2v_a14b": "demo:tiny-wan2.2-i2v-a14b"}
REQUEST = {"prompt": "a red fox", "guidance_scale": 4.0, "num_inference_steps": 2, "height": 32, "width": 32,
           "num_frames": 5, "seed": 3}
FIRST_FRAME = 1  # picture(1): the first image the requests give


@pytest.fixture(scope="module", params=["request", "step"])
def runners(request):
    made = {name: DiffusionRunner(DiffusionRunnerConfig(model, batching=request.param, exact_batching=False))
            for name, model in MODELS.items()}
    yield request.param, made
    for runner in made.values():
        runner.close()


def served(runner: DiffusionRunner, **values) -> torch.Tensor:
    [video] = runner.run([runner.parse(REQUEST | values)])
    if isinstance(video, Exception):
        raise video
    return video


def reference(pipeline, negative=ABSENT, **values) -> torch.Tensor:
    given = REQUEST | values
    return call(pipeline, given.pop("prompt"), negative, guidance_scale=given.pop("guidance_scale"),
                seed=given.pop("seed"), **given)[0]


def levels(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.int() - b.int()).abs().max())


def tolerance(batching: str) -> int:
    return 0 if batching == "request" else 1


@pytest.mark.parametrize("negative", ["blurry", "", ABSENT])
@pytest.mark.parametrize("model", ["ti2v", "i2v_a14b"])
def test_a_first_image_gives_the_image_to_video_pipelines_frames(runners, model, negative):
    batching, made = runners
    runner = made[model]
    given = {} if negative is ABSENT else {"negative_prompt": negative}
    video = served(runner, images=[png(FIRST_FRAME)], **given)
    pipeline = image_pipeline(runner.pipeline) if model == "ti2v" else runner.pipeline
    expected = reference(pipeline, negative, image=Image.fromarray(picture(FIRST_FRAME)))
    assert levels(video, expected) <= tolerance(batching)
    # the image is read: another one moves the frames far past the tolerance
    assert levels(video, served(runner, images=[png(2)], **given)) >= 10


def test_the_two_experts_each_run_their_part_of_the_schedule(runners):
    batching, made = runners
    runner = made["t2v_a14b"]
    video = served(runner, negative_prompt="blurry")
    assert levels(video, reference(runner.pipeline, "blurry")) <= tolerance(batching)
    pipeline = runner.pipeline
    one_expert = WanPipeline(tokenizer=pipeline.tokenizer, text_encoder=pipeline.text_encoder, vae=pipeline.vae,
                             scheduler=pipeline.scheduler, transformer=pipeline.transformer)
    one_expert.set_progress_bar_config(disable=True)
    assert levels(video, reference(one_expert, "blurry")) >= 10  # the low-noise expert's step is its own


def test_the_low_noise_expert_takes_its_own_scale_and_one_denoiser_refuses_it(runners):
    """``guidance_scale_2`` (the model card's 3.0 beside 4.0): the pipeline's, on either batching;
    a second scale far enough from the first moves the video (so the comparison can fail); Wan
    2.2 TI2V-5B, one denoiser, refuses it by name, as its pipeline does."""
    batching, made = runners
    runner = made["t2v_a14b"]
    video = served(runner, negative_prompt="blurry", guidance_scale_2=1.5)
    assert levels(video, reference(runner.pipeline, "blurry", guidance_scale_2=1.5)) <= tolerance(batching)
    assert levels(video, served(runner, negative_prompt="blurry")) >= 10
    with pytest.raises(RequestValidationError, match=r"`guidance_scale_2`.*has one denoiser"):
        made["ti2v"].parse(REQUEST | {"guidance_scale_2": 3.0})
    with pytest.raises(RequestValidationError, match=r"`guidance_scale_2`"):
        runner.parse(REQUEST | {"guidance_scale_2": -1.0})


def test_image_to_video_without_an_image_is_refused_by_name(runners):
    _, made = runners
    with pytest.raises(RequestValidationError, match=r"images.*is required"):
        made["i2v_a14b"].parse(REQUEST)
    served(made["i2v_a14b"], images=[png(FIRST_FRAME)])  # and the next request is served


def test_text_only_families_refuse_a_first_image_by_name():
    runner = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-wan2.2-a14b"))
    try:
        with pytest.raises(RequestValidationError, match="images"):
            runner.parse(REQUEST | {"images": [png(FIRST_FRAME)]})
    finally:
        runner.close()


def test_each_expert_keeps_its_own_step_cache_as_diffusers_hooks_do():
    """The reference is diffusers' First Block Cache enabled on both experts, as its users turn it on:
    each expert's hook has its own state, so the low-noise expert's first step computes."""
    threshold, steps = 0.2, 10
    runner = DiffusionRunner(DiffusionRunnerConfig(MODELS["t2v_a14b"], batching="step"))
    counts: list = []
    try:
        request = runner.parse(REQUEST | {"negative_prompt": "blurry", "num_inference_steps": steps,
                                          "step_cache": f"first_block:{threshold}"})
        ours = runner.submit(request, on_cached=lambda computed, skipped: counts.append((computed, skipped))).result()
    finally:
        runner.close()
    pipeline = DiffusionPipeline.from_pretrained(resolve_model(MODELS["t2v_a14b"]))
    for expert in (pipeline.transformer, pipeline.transformer_2):
        expert.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    with torch.inference_mode():
        output = pipeline(prompt=REQUEST["prompt"], negative_prompt="blurry", guidance_scale=4.0,
                          num_inference_steps=steps, height=32, width=32, num_frames=5, output_type="pt",
                          generator=torch.Generator().manual_seed(REQUEST["seed"]))
    [(computed, skipped)] = counts
    assert computed + skipped == steps and 0 < skipped < steps, counts
    assert levels(ours, to_pixels(output.frames)[0]) == 0


def test_an_image_to_video_pipeline_without_experts_is_refused_by_its_config():
    """Wan 2.1's image-to-video (one DiT, no boundary; it reads a CLIP image encoder) is not served:
    the error says the class is, its config is not."""
    from triton_omni.families import family_of

    pipeline = DiffusionPipeline.from_pretrained(resolve_model(MODELS["i2v_a14b"]))
    assert family_of(pipeline).name == "wan2.2_i2v_a14b"
    pipeline.register_to_config(boundary_ratio=None)
    with pytest.raises(ValueError, match=r"no family serves this WanImageToVideoPipeline's config"):
        family_of(pipeline)
