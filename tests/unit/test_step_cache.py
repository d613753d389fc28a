"""Step caching per request inside step batching (tiny random-weight
pipelines, CPU): First Block Cache alone takes diffusers' own decisions
(Qwen-Image against its pipeline with ``enable_cache``), and a request
step-batched beside others (cached or not, other steps, guidance, seeds)
gives the image it gives alone with the same method. Its typed errors name
``step_cache``."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.hooks import FirstBlockCacheConfig
from triton_omni.demo_models import resolve_model
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion.step_cache import DEFAULT_THRESHOLD, StepCacheConfig, parse_step_cache
from triton_omni.diffusion.steps import to_pixels
from triton_omni.errors import RequestValidationError

FAMILIES = {"qwen_image": "demo:tiny-qwen-image", "z_image": "demo:tiny-z-image",
            "flux2_klein": "demo:tiny-flux2-klein", "flux1": "demo:tiny-flux1-dev", "wan": "demo:tiny-wan"}
# Thresholds at which the tiny random-weight DiTs skip some of 10 steps, not all
THRESHOLDS = {"qwen_image": 0.4, "z_image": 0.8, "flux2_klein": 0.8, "flux1": 0.2, "wan": 0.2}
# The keyword each pipeline reads the request's scale from (Qwen-Image: true CFG)
GUIDANCE_KEYWORD = {"qwen_image": "true_cfg_scale", "flux1": "guidance_scale", "wan": "guidance_scale"}
# What a family's requests here give besides REQUEST (a video's frame count: the model's default set to it)
CALL = {"wan": {"num_frames": 5}}
REQUEST = {"prompt": "a red fox", "negative_prompt": "blurry", "num_inference_steps": 10, "guidance_scale": 4.0,
           "height": 32, "width": 32, "seed": 3}


@pytest.fixture(scope="module", params=list(FAMILIES))
def stepper(request):
    runner = DiffusionRunner(DiffusionRunnerConfig(FAMILIES[request.param], batching="step", batch_size=8,
                                                   defaults=CALL.get(request.param, {}),
                                                   exact_batching=False))
    yield request.param, runner
    runner.close()


def submit(runner: DiffusionRunner, values: dict, counts: list | None = None):
    request = runner.parse(values)
    return runner.submit(request, on_cached=None if counts is None else lambda c, s: counts.append((c, s)))


def max_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.int() - b.int()).abs().max())


@pytest.mark.parametrize(("text", "expected"), [
    ("off", StepCacheConfig()), ("first_block", StepCacheConfig("first_block", DEFAULT_THRESHOLD)),
    ("first_block:0.12", StepCacheConfig("first_block", 0.12)),
    (" first_block:1 ", StepCacheConfig("first_block", 1.0)),
])
def test_step_cache_values_parse(text, expected):
    assert parse_step_cache(text) == expected


@pytest.mark.parametrize("text", ["teacache", "first_block:", "first_block:x", "first_block:0", "first_block:1.5",
                                  "first_block:-0.1", "off:0.1", ""])
def test_a_malformed_step_cache_is_refused_by_name(text):
    runner = DiffusionRunner(DiffusionRunnerConfig(FAMILIES["qwen_image"], batching="step"))
    try:
        with pytest.raises(RequestValidationError, match="invalid `step_cache`"):
            runner.parse(REQUEST | {"step_cache": text})
    finally:
        runner.close()


@pytest.mark.parametrize("family", list(GUIDANCE_KEYWORD))
def test_alone_a_request_takes_diffusers_first_block_cache_decisions(family):
    """The reference is diffusers' own hook on the pipeline's own loop, as a user of diffusers turns it
    on (the families whose blocks diffusers' hook runs: Qwen-Image, FLUX.1 and Wan)."""
    threshold = THRESHOLDS[family]
    runner = DiffusionRunner(DiffusionRunnerConfig(FAMILIES[family], batching="step", defaults=CALL.get(family, {})))
    counts: list = []
    try:
        ours = submit(runner, REQUEST | {"step_cache": f"first_block:{threshold}"}, counts).result()
    finally:
        runner.close()
    pipeline = DiffusionPipeline.from_pretrained(resolve_model(FAMILIES[family]))
    pipeline.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    with torch.inference_mode():
        output = pipeline(prompt=REQUEST["prompt"], negative_prompt=REQUEST["negative_prompt"],
                          **{GUIDANCE_KEYWORD[family]: 4.0}, num_inference_steps=10, height=32, width=32,
                          output_type="pt", generator=torch.Generator().manual_seed(REQUEST["seed"]),
                          **CALL.get(family, {}))
    images = output.frames if family in CALL else output.images
    [(computed, skipped)] = counts
    assert computed + skipped == 10 and 0 < skipped < 10, counts
    assert max_difference(ours, to_pixels(images)[0]) == 0


def test_a_cached_request_in_company_gives_its_image_alone(stepper):
    family, runner = stepper
    method = f"first_block:{THRESHOLDS[family]}"
    alone_counts: list = []
    alone = submit(runner, REQUEST | {"step_cache": method}, alone_counts).result()
    uncached_alone = submit(runner, REQUEST | {"seed": 11}).result()
    company = [REQUEST | {"step_cache": method},  # the request measured alone
               REQUEST | {"seed": 11},  # uncached (the model's default: off) in the same forward passes
               REQUEST | {"seed": 5, "num_inference_steps": 13, "step_cache": method},
               REQUEST | {"seed": 7, "guidance_scale": 0.0, "step_cache": "first_block:0.9"}]
    counts: list = [[] for _ in company]
    futures = [submit(runner, values, counts[i]) for i, values in enumerate(company)]
    images = [future.result() for future in futures]
    assert max_difference(images[0], alone) <= 1 and max_difference(images[1], uncached_alone) <= 1
    assert counts[0] == alone_counts and counts[1] == []  # the same decisions; no cache, no count
    assert all(sum(c[0]) == values["num_inference_steps"] for c, values in zip(counts, company, strict=True) if c)
    assert alone_counts[0][1] > 0, "the threshold should skip some steps"


def test_step_cache_off_by_request_on_a_cached_model():
    runner = DiffusionRunner(DiffusionRunnerConfig(FAMILIES["z_image"], batching="step",
                                                   step_cache=f"first_block:{THRESHOLDS['z_image']}"))
    try:
        on: list = []
        off: list = []
        cached = submit(runner, REQUEST, on).result()
        plain = submit(runner, REQUEST | {"step_cache": "off"}, off).result()
    finally:
        runner.close()
    assert on and on[0][1] > 0 and off == []
    assert max_difference(cached, plain) > 0


def test_families_without_a_step_cache_refuse_it_by_name():
    sd = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", batching="step"))
    try:
        with pytest.raises(RequestValidationError, match=r"step_cache.*has no step cache"):
            sd.parse({"prompt": "x", "step_cache": "first_block"})
        assert sd.parse({"prompt": "x", "step_cache": "off"}).step_cache == StepCacheConfig()
    finally:
        sd.close()
    with pytest.raises(ValueError, match=r"step_cache 'first_block'.*has no step cache"):
        DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", batching="step", step_cache="first_block"))


def test_request_batching_refuses_a_step_cache():
    with pytest.raises(ValueError, match="step_cache needs batching 'step'"):
        DiffusionRunnerConfig(FAMILIES["qwen_image"], batching="request", step_cache="first_block")
    runner = DiffusionRunner(DiffusionRunnerConfig(FAMILIES["qwen_image"], batching="request"))
    with pytest.raises(RequestValidationError, match=r"step_cache.*batching 'step'"):
        runner.parse(REQUEST | {"step_cache": "first_block"})


def test_a_malformed_model_parameter_fails_the_load_by_name():
    with pytest.raises(ValueError, match="model parameter step_cache 'fbc'"):
        DiffusionRunnerConfig(FAMILIES["qwen_image"], batching="step", step_cache="fbc")
