"""Qwen-Image-Edit in the runtime, without a server: an edit equals `QwenImageEditPipeline`'s own
call with the same image, prompt, negative prompt and seed (request batching and step batching,
alone and beside other edits, with the step cache as diffusers' own First Block Cache); the
output's size is the pipeline's, taken from the image; `ar_encoder`'s recipe reads the prompt
with the image as the pipeline's `encode_prompt` does (the vision tower). Edit-Plus
(`QwenImageEditPlusPipeline`) likewise, with several images. The tiny demo is sensitive to its
input image as much as to its prompt (test_demo_sensitivity.py)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FirstBlockCacheConfig
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image
from triton_omni.ar import EncodeRequest
from triton_omni.ar.runner import ArRunner, ArRunnerConfig
from triton_omni.ar.sampling import ArLimits
from triton_omni.demo_models import resolve_model
from triton_omni.diffusion.runner import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion.steps import to_pixels
from triton_omni.errors import RequestValidationError
from triton_omni.families import family_of

from tests.support.images import encoded, picture
from tests.support.pipelines import ABSENT, call, levels_apart, pipeline, reference

MODEL = "demo:tiny-qwen-image-edit"
FAMILY = "qwen-image-edit"
PICTURES = {"first": picture(1), "second": picture(2, 48, 96)}
# "first" with its top rows inverted: rows off InputLatents' fingerprint grid (rows 4, 12, ... of 64),
# so the fingerprints agree and only the full comparison tells the two apart
PICTURES["first, top inverted"] = np.concatenate([255 - PICTURES["first"][:4], PICTURES["first"][4:]])
OPTIONS = {"num_inference_steps": 2, "height": 32, "width": 32, "seed": 7}
PROMPT = "make the fox blue"


def request(prompt: str = PROMPT, negative=ABSENT, guidance: float = 4.0, image: str = "first", **options) -> dict:
    given = {} if negative is ABSENT else {"negative_prompt": negative}
    return {"prompt": prompt, **given, "guidance_scale": guidance, "images": [encoded(PICTURES[image])],
            **(OPTIONS | options)}


@functools.cache
def expected(prompt: str = PROMPT, negative=ABSENT, guidance: float = 4.0, image: str = "first", **options):
    return reference(FAMILY, prompt, negative, guidance_scale=guidance, image=Image.fromarray(PICTURES[image]),
                     **(OPTIONS | options))


@pytest.fixture(scope="module")
def runner():
    """Request batching (step batching: the company test below)."""
    runner = DiffusionRunner(DiffusionRunnerConfig(MODEL, batching="request", batch_size=4))
    yield runner
    runner.close()


def test_an_edit_equals_the_pipelines_own_call(runner):
    """A text negative under true CFG (the other forms below, step-batched)."""
    [image] = runner.run([runner.parse(request(negative="blurry"))])
    assert levels_apart(image.numpy(), expected(negative="blurry")) <= 1


def test_edits_step_batched_together_each_give_their_own_image():
    """Edits of other images, prompts, negatives ("": a negative all the same; none: no true CFG)
    and output sizes in one batch (their sequences differ: each steps in its own group, or beside
    the edit of its layout)."""
    cases = [{"image": "first", "negative": ""}, {"image": "second", "prompt": "a lighthouse", "negative": "blurry"},
             {"image": "second", "height": 64}]
    runner = DiffusionRunner(DiffusionRunnerConfig(MODEL, batching="step", batch_size=4))
    try:
        images = runner.run([runner.parse(request(**case)) for case in cases])
    finally:
        runner.close()
    for case, image in zip(cases, images, strict=True):
        assert levels_apart(image.numpy(), expected(**case)) <= 1, case


def test_edits_of_one_picture_encode_it_once_each_with_its_own_image():
    """Requests giving the same picture (OpenAI's `n`, a user's successive edits) share its VAE
    latents, as the pipeline's batch does; a picture that differs where the fingerprint does not
    look is encoded on its own."""
    cases = [{"image": "first"}, {"image": "first", "prompt": "a lighthouse", "seed": 8},
             {"image": "first, top inverted"}]
    runner = DiffusionRunner(DiffusionRunnerConfig(MODEL, batching="step", batch_size=4))
    try:
        images = runner.run([runner.parse(request(**case)) for case in cases])
        assert runner.steps.adapter.input_latents.hits == 1
    finally:
        runner.close()
    for case, image in zip(cases, images, strict=True):
        assert levels_apart(image.numpy(), expected(**case)) <= 1, case
    assert levels_apart(expected(image="first, top inverted"), expected()) >= 10  # the inverted rows show


def test_the_output_takes_the_pipelines_size_from_the_image(runner):
    """Without height and width the pipeline edits at about 1024² pixels, at the image's aspect."""
    parsed = runner.parse({"prompt": PROMPT, "images": [encoded(PICTURES["second"])]})
    width, height, _ = calculate_dimensions(1024 * 1024, 96 / 48)
    assert (parsed.height, parsed.width) == (height, width)


def test_an_edit_takes_embeddings_as_long_as_its_images_make_them(runner):
    """A released processor reads a 1024² image as about 1340 vision tokens, which the prompt's
    embeddings hold: an edit model's default bound is 2048 tokens, not 512."""
    parsed = runner.parse({"prompt_embeds": torch.zeros(1500, 64), "images": [encoded(PICTURES["first"])]} | OPTIONS)
    assert parsed.prompt_embeds.shape[0] == 1500 and runner.limits.max_embeds_tokens == 2048


def test_an_edit_without_an_image_is_refused_naming_images(runner):
    for inputs in ({"prompt": PROMPT}, {"prompt_embeds": torch.zeros(4, 64)}):
        with pytest.raises(RequestValidationError, match="invalid `images`: is required") as caught:
            runner.parse(inputs | OPTIONS)
        assert caught.value.parameter == "images"


def test_the_step_cache_takes_diffusers_first_block_cache_decisions():
    """An edit with the step cache, against diffusers' own hook on the pipeline's own loop."""
    runner = DiffusionRunner(DiffusionRunnerConfig(MODEL, batching="step"))
    counts = []
    try:
        parsed = runner.parse(request(negative="blurry", num_inference_steps=4, step_cache="first_block:0.4"))
        ours = runner.submit(parsed, on_cached=lambda computed, skipped: counts.append((computed, skipped))).result()
    finally:
        runner.close()
    cached = DiffusionPipeline.from_pretrained(resolve_model(MODEL))
    cached.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.4))
    with torch.inference_mode():
        images = cached(image=Image.fromarray(PICTURES["first"]), prompt=PROMPT, negative_prompt="blurry",
                        true_cfg_scale=4.0, num_inference_steps=4, height=32, width=32, output_type="pt",
                        generator=torch.Generator().manual_seed(OPTIONS["seed"])).images
    [(computed, skipped)] = counts
    assert computed + skipped == 4 and 0 < skipped < 4, counts
    # Bit-exact on some hosts; on an AVX2-only AMD EPYC one pixel channel of 3072 lands a level apart,
    # every time (a skipped step's residual added in another rounding). Another skip decision moves
    # this image 18 to 28 levels, so within 1 the test still tells the decisions apart.
    assert levels_apart(ours.numpy(), to_pixels(images)[0].numpy()) <= 1


@pytest.fixture(scope="module")
def encoder():
    runner = ArRunner(ArRunnerConfig(MODEL, mode="encode", engine="transformers", recipe="qwen_image_edit"))
    yield runner
    runner.close()


def encode(runner: ArRunner, inputs: dict):
    parsed = EncodeRequest.from_inputs(inputs, ArLimits(), False, runner.image_limits)
    [result] = runner.loop.run(runner.encode([parsed]))
    return result


def pipeline_encoding(prompt: str, image: str, family: str = FAMILY) -> torch.Tensor:
    """The pipeline's ``encode_prompt`` with ``image`` (Edit-Plus: every picture, ``image`` last)."""
    edit = pipeline(family)
    images = [Image.fromarray(PICTURES[name]) for name in ([image] if family == FAMILY else PLUS_ORDER[image])]
    with torch.inference_mode():
        embeds, mask = edit.encode_prompt(prompt, image=family_of(edit).encoder_images(images))
    return embeds[0] if mask is None else embeds[0][mask[0].bool()]


@pytest.mark.parametrize("negative", ["blurry", "", None])
def test_ar_encoder_reads_the_prompt_with_the_image_as_the_pipeline(encoder, negative):
    """Both sides read the image; an absent negative prompt is zero tokens (no true CFG)."""
    given = {} if negative is None else {"negative_prompt": negative}
    for image in PICTURES:
        result = encode(encoder, {"text_input": PROMPT, **given, "images": [encoded(PICTURES[image])]})
        assert (result.hidden_states - pipeline_encoding(PROMPT, image)).abs().max() <= 1e-4
        if negative is None:
            assert result.negative_hidden_states is None
        else:
            expected_negative = pipeline_encoding(negative, image)
            assert result.negative_hidden_states.shape == expected_negative.shape
            assert (result.negative_hidden_states - expected_negative).abs().max() <= 1e-4
    other = pipeline_encoding(PROMPT, "second")[: result.hidden_states.shape[0]]
    assert (pipeline_encoding(PROMPT, "first")[: other.shape[0]] - other).abs().max() > 0.1  # the image is read


def test_ar_encoder_refuses_a_prompt_without_its_image(encoder):
    with pytest.raises(RequestValidationError, match="invalid `images`: is required"):
        encode(encoder, {"text_input": PROMPT})
    with pytest.raises(RequestValidationError, match="invalid `images`: this model takes at most 1"):
        encode(encoder, {"text_input": PROMPT, "images": [encoded(PICTURES["first"])] * 2})


def test_cfg_parallel_gives_the_pipelines_edit():
    """The negatives' passes of an edit in a worker process (on the CPU here)."""
    runner = DiffusionRunner(DiffusionRunnerConfig(MODEL, batching="step", cfg_device="cpu"))
    try:
        edit = runner.submit(runner.parse(request(negative="blurry"))).result()
    finally:
        runner.close()
    assert levels_apart(edit.numpy(), expected(negative="blurry")) <= 1


def test_sequence_parallel_is_refused_at_load_naming_it():
    """It splits the output's tokens, which an edit's image latents follow."""
    with pytest.raises(ValueError, match="the qwen_image_edit family does not take sequence parallel"):
        DiffusionRunner(DiffusionRunnerConfig(MODEL, batching="step", sp_devices=("cpu", "cpu")))


PLUS = "demo:tiny-qwen-image-edit-plus"
PLUS_ORDER = {"first": ["second", "first"], "second": ["first", "second"]}  # the output takes the last one's size


@functools.cache
def plus_reference(prompt: str, negative) -> np.ndarray:
    """Edit-Plus's own call with both images (``PLUS_ORDER["first"]``)."""
    return reference("qwen-image-edit-plus", prompt, negative, guidance_scale=4.0,
                     image=[Image.fromarray(PICTURES[name]) for name in PLUS_ORDER["first"]], **OPTIONS)


def test_edit_plus_with_two_images_equals_the_pipelines_own_call():
    """Both images read by the text encoder (at about 384² each) and by the VAE (about 1024² each),
    step-batched; the prompt read with both."""
    runner = DiffusionRunner(DiffusionRunnerConfig(PLUS, batching="step", batch_size=4))
    try:
        files = [encoded(PICTURES[name]) for name in PLUS_ORDER["first"]]
        [image] = runner.run([runner.parse(request(negative="blurry") | {"images": files})])
    finally:
        runner.close()
    assert levels_apart(image.numpy(), plus_reference(PROMPT, "blurry")) <= 1
    assert levels_apart(image.numpy(), expected(negative="blurry")) >= 10  # not the one-image edit


def test_ar_encoder_reads_the_prompt_with_every_image_of_an_edit_plus():
    runner = ArRunner(ArRunnerConfig(PLUS, mode="encode", engine="transformers", recipe="qwen_image_edit_plus"))
    try:
        files = [encoded(PICTURES[name]) for name in PLUS_ORDER["first"]]
        result = encode(runner, {"text_input": PROMPT, "negative_prompt": "", "images": files})
    finally:
        runner.close()
    expected_states = pipeline_encoding(PROMPT, "first", "qwen-image-edit-plus")
    assert result.hidden_states.shape == expected_states.shape
    assert (result.hidden_states - expected_states).abs().max() <= 1e-4
    assert (result.negative_hidden_states - pipeline_encoding("", "first", "qwen-image-edit-plus")).abs().max() <= 1e-4


def test_edit_plus_2511_reads_its_images_at_time_zero_as_its_pipeline(tmp_path):
    """Qwen-Image-Edit-2511's DiT (``zero_cond_t``: the input images' tokens modulated at time 0, by
    each row's image shapes), step-batched: an edit with two images and a negative prompt is the
    pipeline's own call from the same folder, and 2509's DiT (the same weights) gives another image
    (the comparison can fail)."""
    import json
    import shutil

    folder = tmp_path / "qwen-image-edit-2511"
    shutil.copytree(resolve_model(PLUS), folder)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"zero_cond_t": True}))
    runner = DiffusionRunner(DiffusionRunnerConfig(str(folder), batching="step", batch_size=4))
    try:
        files = [encoded(PICTURES[name]) for name in PLUS_ORDER["first"]]
        [image] = runner.run([runner.parse(request(negative="blurry") | {"images": files})])
    finally:
        runner.close()
    pictures = [Image.fromarray(PICTURES[name]) for name in PLUS_ORDER["first"]]
    pipe = DiffusionPipeline.from_pretrained(folder)
    ours = call(pipe, PROMPT, "blurry", guidance_keyword="true_cfg_scale", guidance_scale=4.0, image=pictures,
                **OPTIONS)[0].numpy()
    assert levels_apart(image.numpy(), ours) <= 1
    assert levels_apart(image.numpy(), plus_reference(PROMPT, "blurry")) >= 10
