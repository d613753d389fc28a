"""Every family the diffusion runner serves gives the image of its pipeline's
own ``__call__``: same prompt, negative prompt, steps, guidance, size and
seeded generator, on tiny random-weight models (diffusers' test shapes).
Alone, bit-exact; batched beside other requests, within 1/255 per pixel, or
bit-exact with ``exact_batching: pipeline``. A video family (Wan 2.1, Wan 2.2 TI2V and T2V-A14B,
whose two experts step requests at either side of their boundary in one group) the same, every frame: its
requests here make ``FRAMES`` frames (the model's default set so, and the pipeline called with it)."""

from __future__ import annotations

import pytest
import torch
from triton_omni.diffusion.request import DiffusionLimits, DiffusionRequest
from triton_omni.diffusion.runner import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion.steps import to_pixels
from triton_omni.errors import RequestValidationError

from tests.support.pipelines import call

STEPS, SIZE, FRAMES = 2, 32, 5
MODELS = {"stable_diffusion": "demo:tiny-sd", "qwen_image": "demo:tiny-qwen-image", "z_image": "demo:tiny-z-image",
          "flux2_klein": "demo:tiny-flux2-klein", "flux2_dev": "demo:tiny-flux2-dev", "flux1": "demo:tiny-flux1-dev",
          "wan": "demo:tiny-wan", "wan2.2_ti2v": "demo:tiny-wan2.2", "wan2.2_a14b": "demo:tiny-wan2.2-a14b"}
VIDEO = {"wan", "wan2.2_ti2v", "wan2.2_a14b"}


def config(family: str, **settings) -> DiffusionRunnerConfig:
    """The family's tiny demo; a video family's requests make ``FRAMES`` frames unless they say."""
    return DiffusionRunnerConfig(MODELS[family], defaults={"num_frames": FRAMES} if family in VIDEO else {},
                                 **settings)


@pytest.fixture(scope="module", params=list(MODELS))
def runner(request) -> DiffusionRunner:
    return DiffusionRunner(config(request.param, exact_batching=False, batch_size=4))


def served(runner: DiffusionRunner, *requests: dict) -> list[torch.Tensor]:
    results = runner.run([runner.parse({"num_inference_steps": STEPS, "height": SIZE, "width": SIZE} | values)
                          for values in requests])
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def reference(runner: DiffusionRunner, prompt: str, seed: int, guidance: float, negative: str | None = None,
              size: int = SIZE, steps: int = STEPS, height: int | None = None) -> torch.Tensor:
    """The pipeline's own call, as its documentation shows it."""
    guidance_key = "true_cfg_scale" if runner.family.name == "qwen_image" else "guidance_scale"
    frames = {"num_frames": FRAMES} if runner.output.video else {}
    return call(runner.pipeline, prompt, negative, guidance_keyword=guidance_key, guidance_scale=guidance, seed=seed,
                num_inference_steps=steps, height=height or size, width=size, **frames)[0]


def encoded(runner: DiffusionRunner, text: str) -> torch.Tensor:
    """``text`` as the runner encodes a prompt: its pipeline's encoding, under inference mode (with
    autograd on, CPU attention takes another kernel and the last bits differ)."""
    return runner._encode_prompt(text)[0]


def conditioning(runner: DiffusionRunner, text: str) -> dict:
    """``text``'s request inputs as ar_encoder sends them: its embeddings, and its pooled embedding
    where the family reads one (FLUX.1's CLIP vector)."""
    embeds, pooled = runner._encode_prompt(text)
    return {"prompt_embeds": embeds} | ({} if pooled is None else {"pooled_prompt_embeds": pooled})


def test_served_alone_equals_the_pipelines_own_call(runner):
    [image] = served(runner, {"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 4.0, "seed": 3})
    assert torch.equal(image, reference(runner, "a red fox", 3, 4.0, "blurry"))


def test_without_guidance_equals_the_pipelines_own_call(runner):
    off = 0.0 if runner.family.name == "z_image" else 1.0  # each family's "no guidance"
    [image] = served(runner, {"prompt": "a lighthouse", "guidance_scale": off, "seed": 5})
    assert torch.equal(image, reference(runner, "a lighthouse", 5, off))


def test_the_pipelines_default_negative_prompt(runner):
    """No negative prompt: SD and Z-Image guide against "", Qwen-Image does not guide (diffusers' rules)."""
    [image] = served(runner, {"prompt": "a red fox", "guidance_scale": 4.0, "seed": 2})
    assert torch.equal(image, reference(runner, "a red fox", 2, 4.0))


def test_batched_beside_other_requests_stays_within_one_level(runner):
    alone = reference(runner, "a red fox", 3, 4.0, "blurry")
    batch = served(runner,
                   {"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 4.0, "seed": 3},
                   {"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 4.0, "seed": 11},
                   {"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 4.0, "seed": 12},
                   {"prompt": "a watercolor lighthouse", "guidance_scale": 1.0, "seed": 4, "num_inference_steps": 3},
                   {"prompt": "a red fox", "guidance_scale": 2.0, "seed": 6, "height": 2 * SIZE})
    assert (batch[0].int() - alone.int()).abs().max() <= 1
    assert batch[3].shape[-3:] == (SIZE, SIZE, 3) and batch[4].shape[-3:] == (2 * SIZE, SIZE, 3)
    assert not torch.equal(batch[0], batch[1])  # each request its own generator


def test_prompt_embeds_give_the_prompts_image(runner):
    """What `ar_encoder` sends for a family: the pipeline's own encoding of the prompt. Each served
    alone: two rows of one batch may round their last bit differently on the CPU (an AVX-512 host's
    kernels put Wan's two identical rows 1 level apart), which is no question of the encoding."""
    negative = encoded(runner, "blurry")
    [from_text] = served(runner, {"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 4.0, "seed": 3})
    [from_embeds] = served(runner, conditioning(runner, "a red fox") | {"negative_prompt_embeds": negative,
                                                                        "guidance_scale": 4.0, "seed": 3})
    assert torch.equal(from_text, from_embeds)


def test_embeddings_without_a_negative_get_the_pipelines_default_negative(runner):
    """No negative at all: the family's pipeline default, from its own text encoder (SD and Z-Image:
    the encoding of ""; Qwen-Image: no true CFG). Zero negative tokens (ar_encoder's answer where
    the pipeline runs without a negative) guide against the null condition, or not at all."""
    given = conditioning(runner, "a red fox")
    embeds = given["prompt_embeds"]
    # one call each: FLUX.2's two would share a batch (every prompt is 512 tokens), whose size moves the last bit
    [image] = served(runner, given | {"guidance_scale": 4.0, "seed": 2})
    [nulled] = served(runner, given | {"negative_prompt_embeds": embeds[:0], "guidance_scale": 4.0, "seed": 2})
    assert torch.equal(image, reference(runner, "a red fox", 2, 4.0))
    if runner.family.name == "qwen_image" or not runner.family.uses_guidance(4.0, has_negative=True):
        assert torch.equal(nulled, image)  # Qwen-Image: no negative, no true CFG; FLUX [dev]: never a negative
    else:
        assert (nulled.int() - image.int()).abs().max() >= 10


def test_the_empty_prompt_is_encoded_once(runner, monkeypatch):
    """Every guided request without a negative guides against the same encoding of "": encoded at
    the first, not at each admission (on a GPU, that encoding waited for the device)."""
    if not runner.family.uses_guidance(4.0, has_negative=False):
        return  # Qwen-Image: no negative, no guidance
    encoded = []
    encode = runner.family.encode
    monkeypatch.setattr(runner.family, "encode", lambda text, device: encoded.append(text) or encode(text, device))
    embeds = encode("a red fox", runner.device)
    served(runner, *({"prompt_embeds": embeds, "guidance_scale": 4.0, "seed": seed} for seed in (1, 2, 3)))
    served(runner, {"prompt_embeds": embeds, "negative_prompt": "", "guidance_scale": 4.0, "seed": 4})
    assert encoded.count("") <= 1


def test_without_a_text_encoder_guided_embeddings_need_their_negative(runner, monkeypatch):
    given = conditioning(runner, "a red fox")
    embeds = given["prompt_embeds"]
    monkeypatch.setattr(runner.family, "has_text_encoder", lambda: False)  # as the realistic GPU presets
    request = given | {"guidance_scale": 4.0}
    if not runner.family.uses_guidance(4.0, has_negative=False):  # Qwen-Image, FLUX.2 [dev]: nothing to encode
        runner.parse(request)
        return
    with pytest.raises(RequestValidationError, match="negative_prompt_embeds"):
        runner.parse(request)
    runner.parse(request | {"negative_prompt_embeds": embeds})


def test_a_size_the_model_cannot_take_names_it(runner):
    multiple = runner.limits.size_multiple
    with pytest.raises(RequestValidationError, match=f"height.*multiple of {multiple}"):
        runner.parse({"prompt": "a red fox", "height": SIZE + multiple // 2 or 1, "width": SIZE})


@pytest.fixture(scope="module", params=list(MODELS))
def stepper(request) -> DiffusionRunner:
    """Step batching: requests join and leave the running batch at every step."""
    runner = DiffusionRunner(config(request.param, batching="step", batch_size=4))
    yield runner
    runner.close()


def test_step_batched_alone_equals_the_pipelines_own_call(stepper):
    [image] = served(stepper, {"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 4.0, "seed": 3})
    assert (image.int() - reference(stepper, "a red fox", 3, 4.0, "blurry").int()).abs().max() <= 1


def test_step_batched_beside_other_steps_sizes_and_guidance(stepper):
    """Requests of other step counts, sizes and guidance in the running batch: each request's
    image within one level of its pipeline's call alone."""
    requests = [({"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 4.0, "seed": 3}, 2, SIZE),
                ({"prompt": "a red fox", "guidance_scale": 0.0, "seed": 9, "num_inference_steps": 4}, 4, SIZE),
                ({"prompt": "a lighthouse", "negative_prompt": "dark", "guidance_scale": 2.5, "seed": 5,
                  "height": 2 * SIZE}, 2, 2 * SIZE)]
    # The references first: the pipeline called from this thread while the engine's thread encodes with the
    # same text encoder races it (Qwen2.5-VL keeps its rope deltas on the module between calls)
    expected = [reference(stepper, values["prompt"], values["seed"], values["guidance_scale"],
                          values.get("negative_prompt"), steps=steps, height=height)
                for values, steps, height in requests]
    futures = [stepper.submit(stepper.parse({"num_inference_steps": STEPS, "height": SIZE, "width": SIZE} | values))
               for values, _, _ in requests]
    for future, reference_image, (values, _, _) in zip(futures, expected, requests, strict=True):
        assert (future.result(timeout=300).int() - reference_image.int()).abs().max() <= 1, values


# Three requests that share every forward pass (one group), beside others of other steps and sizes.
COMPANY = [{"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 4.0, "seed": seed}
           for seed in (3, 11, 12)] + [
    {"prompt": "a red fox", "guidance_scale": 2.0, "seed": 9, "num_inference_steps": 3},
    {"prompt": "a lighthouse", "negative_prompt": "dark", "guidance_scale": 2.5, "seed": 5, "height": 2 * SIZE,
     "width": 2 * SIZE}]


@pytest.mark.parametrize("batching", ["request", "step"])
@pytest.mark.parametrize("family", list(MODELS))
def test_exact_batching_pipeline_is_bit_exact_in_any_company(family, batching):
    """``exact_batching: pipeline``: each request's passes at its pipeline's own batch size, so its
    image equals the pipeline's call alone bit for bit, whatever shares the batch."""
    runner = DiffusionRunner(config(family, batching=batching, batch_size=4, exact_batching="pipeline"))
    try:
        if batching == "step":
            futures = [runner.submit(runner.parse({"num_inference_steps": STEPS, "height": SIZE, "width": SIZE}
                                                  | values)) for values in COMPANY]
            images = [future.result(timeout=300) for future in futures]
            assert runner.steps.max_rows_seen <= 2  # one request's rows a pass
        else:
            images = served(runner, *COMPANY)
        for image, values in zip(images, COMPANY, strict=True):
            expected = reference(runner, values["prompt"], values["seed"], values["guidance_scale"],
                                 values.get("negative_prompt"), values.get("height", SIZE),
                                 values.get("num_inference_steps", STEPS))
            assert torch.equal(image, expected), values
    finally:
        runner.close()


def test_z_image_prompts_of_one_padded_length_share_each_pass():
    """Z-Image's DiT pads every caption to a multiple of 32 tokens itself: prompts of 20 and 25
    tokens step in one forward pass (40 in a pass of its own), each image still bit-identical to
    the same request alone (``exact_batching: true``)."""
    runner = DiffusionRunner(DiffusionRunnerConfig(MODELS["z_image"], batching="step", batch_size=4,
                                                   exact_batching=True))

    def values(tokens: int, seed: int) -> dict:
        embeds = torch.randn(tokens, runner.limits.hidden_size, generator=torch.Generator().manual_seed(seed))
        return {"prompt_embeds": embeds, "guidance_scale": 0.0, "seed": seed, "num_inference_steps": STEPS,
                "height": SIZE, "width": SIZE}

    requests = [values(20, 1), values(25, 2), values(40, 3)]
    try:
        alone = [runner.submit(runner.parse(v)).result(timeout=300) for v in requests]
        assert runner.steps.max_rows_seen == 1
        together = [f.result(timeout=300) for f in [runner.submit(runner.parse(v)) for v in requests]]
        assert runner.steps.max_rows_seen == 2
        for a, t in zip(alone, together, strict=True):
            assert torch.equal(a, t)
    finally:
        runner.close()


def test_exact_batching_takes_three_values():
    with pytest.raises(ValueError, match="exact_batching must be one of true, false, pipeline, got 'always'"):
        DiffusionRunnerConfig(MODELS["z_image"], exact_batching="always")


def test_a_pipeline_without_its_text_encoder_takes_embeddings_only():
    """The realistic GPU presets are built without text encoders: a text prompt gets a typed error."""
    runner = DiffusionRunner(DiffusionRunnerConfig(MODELS["qwen_image"], exact_batching=False))
    runner.pipeline.text_encoder = None
    [result] = runner.run([runner.parse({"prompt": "a red fox", "num_inference_steps": STEPS, "height": SIZE,
                                         "width": SIZE})])
    assert isinstance(result, RequestValidationError) and "prompt_embeds" in str(result)


@pytest.mark.parametrize("batching", ["request", "step"])
def test_a_step_distilled_flux2_klein_never_guides(batching):
    """FLUX.2 [klein]'s step-distilled variant (``is_distilled``) ignores the guidance scale as its
    pipeline does: one pass a step, and the pipeline's image at any scale."""
    runner = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-flux2-klein-distilled", batching=batching,
                                                   batch_size=4))
    try:
        request = runner.parse({"prompt": "a red fox", "guidance_scale": 4.0, "seed": 3, "num_inference_steps": 4,
                                "height": SIZE, "width": SIZE})
        assert not runner._guided(request)
        [image] = runner.run([request])
        expected = reference(runner, "a red fox", 3, 4.0, steps=4)
        assert (image.int() - expected.int()).abs().max() <= (1 if batching == "step" else 0)
        assert torch.equal(expected, reference(runner, "a red fox", 3, 1.0, steps=4))
    finally:
        runner.close()


def test_flux2_embeddings_of_any_length_each_pass_its_own_text_ids():
    """FLUX.2's DiT takes text position ids as long as its text: a prompt and a negative of other
    lengths than the encoder's 512 (as a client may send) each get their own, as the pipeline does."""
    runner = DiffusionRunner(DiffusionRunnerConfig(MODELS["flux2_klein"], batching="step", batch_size=4))
    generator = torch.Generator().manual_seed(0)
    embeds, negative = torch.randn(40, 48, generator=generator), torch.randn(24, 48, generator=generator)
    try:
        [image] = runner.run([runner.parse({"prompt_embeds": embeds, "negative_prompt_embeds": negative, "seed": 3,
                                            "guidance_scale": 4.0, "num_inference_steps": STEPS, "height": SIZE,
                                            "width": SIZE})])
        with torch.inference_mode():
            expected = runner.pipeline(prompt_embeds=embeds[None], negative_prompt_embeds=negative[None],
                                       guidance_scale=4.0, num_inference_steps=STEPS, height=SIZE, width=SIZE,
                                       generator=torch.Generator().manual_seed(3), output_type="pt").images
        assert (image.int() - to_pixels(expected)[0].int()).abs().max() <= 1
    finally:
        runner.close()


def test_flux1_reads_its_pooled_embedding():
    """FLUX.1's DiT reads CLIP's pooled vector beside T5's sequence: another prompt's vector moves
    the image far, one left out or of another width is refused by name, and a family that reads none
    refuses one (zero values, what ar_encoder sends for such a family, mean none)."""
    runner = DiffusionRunner(DiffusionRunnerConfig(MODELS["flux1"], exact_batching=False))
    given = conditioning(runner, "a red fox") | {"guidance_scale": 3.5, "seed": 3}
    other = conditioning(runner, "a watercolor lighthouse")["pooled_prompt_embeds"]
    [image, swapped] = [served(runner, values)[0] for values in (given, given | {"pooled_prompt_embeds": other})]
    assert (image.int() - swapped.int()).abs().max() >= 10
    for values, message in (({"prompt_embeds": given["prompt_embeds"]}, "is required"),
                            (given | {"pooled_prompt_embeds": other[:16]}, r"must be \[32\]"),
                            ({"prompt": "a red fox", "pooled_prompt_embeds": other}, "goes with prompt_embeds")):
        with pytest.raises(RequestValidationError, match=f"`pooled_prompt_embeds`: {message}"):
            runner.parse(values)
    limits = DiffusionLimits(hidden_size=32)  # a family without a pooled embedding
    with pytest.raises(RequestValidationError, match="reads no pooled embedding"):
        DiffusionRequest.from_inputs({"prompt_embeds": given["prompt_embeds"], "pooled_prompt_embeds": other}, limits)
    assert DiffusionRequest.from_inputs({"prompt_embeds": given["prompt_embeds"],
                                         "pooled_prompt_embeds": other[:0]}, limits).pooled_prompt_embeds is None


@pytest.mark.parametrize("batching", ["request", "step"])
def test_flux1_schnell_has_no_guidance(batching):
    """FLUX.1 [schnell]'s DiT has no guidance input: its users' call (guidance 0, 4 steps) and any
    other scale give the same image, which the server gives too."""
    runner = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-flux1-schnell", batching=batching, batch_size=4))
    try:
        [image] = served(runner, {"prompt": "a red fox", "guidance_scale": 3.5, "seed": 3, "num_inference_steps": 4})
        expected = reference(runner, "a red fox", 3, 0.0, steps=4)
        assert (image.int() - expected.int()).abs().max() <= (1 if batching == "step" else 0)
        assert torch.equal(expected, reference(runner, "a red fox", 3, 3.5, steps=4))
    finally:
        runner.close()
