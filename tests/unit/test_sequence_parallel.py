"""Sequence parallel on the CPU (tiny Qwen-Image and Z-Image, gloo): the runner's
transformer runs each forward over this process and worker processes, each
holding a share of the tokens (diffusers' Ulysses attention), and every
image equals the one-process image, alone and beside requests with other
steps, sizes and guidance, under step batching and request batching,
within 1/255 per pixel: each rank's matrix products run on its share of the
tokens, a smaller matrix, whose kernels may round the last bit differently.
tests/gpu runs it over two GPUs; benchmarks/parallel.py --mode sp measures it."""

from __future__ import annotations

import pytest
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.errors import RequestValidationError

from tests.support import fake_pb_utils
from tests.support.images import png

fake_pb_utils.install()
from triton_omni.triton.diffusion_io import runner_config  # noqa: E402  (after the stand-in for pb_utils)

MODEL = "demo:tiny-qwen-image"
REQUEST = {"prompt": "a red fox", "negative_prompt": "blurry", "num_inference_steps": 4, "guidance_scale": 4.0,
           "height": 32, "width": 32, "seed": 3}
# other steps, another size (an odd token count: 6 x 5 patches), no guidance
COMPANY = [REQUEST, REQUEST | {"seed": 5, "num_inference_steps": 6}, REQUEST | {"seed": 7, "width": 40},
           REQUEST | {"seed": 9, "guidance_scale": 1.0, "prompt": "a small boat on a calm lake at dawn"}]


def served(config: DiffusionRunnerConfig, company: list[dict] = COMPANY, alone: bool = True) -> list:
    """Each request alone (unless not ``alone``), then all of them together."""
    runner = DiffusionRunner(config)
    try:
        alone = [runner.run([runner.parse(values)])[0] for values in company] if alone else []
        return alone + runner.run([runner.parse(values) for values in company])
    finally:
        runner.close()


def assert_same(got: list, expected: list) -> None:
    for image, reference in zip(got, expected, strict=True):
        assert not isinstance(image, Exception), image
        assert (image.int() - reference.int()).abs().max() <= 1


@pytest.mark.parametrize("batching", ["step", "request"])
def test_sequence_parallel_gives_the_one_process_images(batching):
    expected = served(DiffusionRunnerConfig(MODEL, batching=batching))
    assert_same(served(DiffusionRunnerConfig(MODEL, batching=batching, sp_devices=("cpu",))), expected)


def test_z_image_splits_its_joint_sequence_with_our_plan():
    """diffusers has no plan for Z-Image; sequence_parallel.py's splits its main layers' joint sequence."""
    company = [values | {"guidance_scale": 1.0} for values in COMPANY[:2]] + COMPANY[2:]
    expected = served(DiffusionRunnerConfig("demo:tiny-z-image", batching="step"), company)
    got = served(DiffusionRunnerConfig("demo:tiny-z-image", batching="step", sp_devices=("cpu",)), company)
    assert_same(got, expected)


def test_flux_splits_its_text_and_image_with_diffusers_plan():
    """FLUX.1's and FLUX.2's transformers ship their context-parallel plan: the image's tokens and the
    text's split at its entry, the output gathered after its last projection. FLUX.1 here (its
    pooled vector and guidance whole on every rank besides); FLUX.2 [klein] takes the same path
    (tests/gpu/test_sequence_parallel.py runs both on two GPUs)."""
    company = [COMPANY[0], COMPANY[3] | {"width": 48}]
    expected = served(DiffusionRunnerConfig("demo:tiny-flux1-dev", batching="step"), company)
    got = served(DiffusionRunnerConfig("demo:tiny-flux1-dev", batching="step", sp_devices=("cpu",)), company)
    assert_same(got, expected)


# Wan: a video's tokens (every latent frame's patches) split by diffusers' plan at the first block.
# Wan 2.2 TI2V-5B takes a timestep per token (split with them) and a first image as its first latent
# frame; T2V-A14B runs two experts, each split, the workers holding both.
VIDEO = {"prompt": "a red fox", "negative_prompt": "blurry", "num_inference_steps": 3, "guidance_scale": 4.0,
         "height": 32, "width": 32, "num_frames": 5, "seed": 3}
VIDEO_COMPANY = {
    "demo:tiny-wan2.2": [VIDEO | {"images": [png(1)]}, VIDEO | {"seed": 5, "num_frames": 9, "width": 64},
                         VIDEO | {"seed": 7, "guidance_scale": 1.0}],
    "demo:tiny-wan2.2-a14b": [VIDEO, VIDEO | {"seed": 5, "num_inference_steps": 5, "width": 48},
                              VIDEO | {"seed": 7, "prompt": "a small boat on a calm lake at dawn", "num_frames": 9}],
}


@pytest.mark.parametrize("model", list(VIDEO_COMPANY))
def test_wan_splits_its_videos_tokens_with_diffusers_plan(model):
    company = VIDEO_COMPANY[model]
    expected = served(DiffusionRunnerConfig(model, batching="step", exact_batching=False), company)
    got = served(DiffusionRunnerConfig(model, batching="step", exact_batching=False, sp_devices=("cpu",)), company)
    assert_same(got, expected)


def test_three_ranks_split_three_heads_and_any_token_count():
    company = [values | {"width": 48} for values in COMPANY]  # 4 x 6 patches: gloo gathers equal shares
    expected = served(DiffusionRunnerConfig(MODEL, batching="step"), company, alone=False)
    got = served(DiffusionRunnerConfig(MODEL, batching="step", sp_devices=("cpu", "cpu")), company, alone=False)
    assert_same(got, expected)


def test_bad_requests_are_invalid_by_name_and_a_dead_worker_fails_the_next_request():
    runner = DiffusionRunner(DiffusionRunnerConfig(MODEL, batching="step", sp_devices=("cpu", "cpu")))
    try:
        with pytest.raises(RequestValidationError, match=r"`height`.*multiple of 3 patches, got '32x32'"):
            runner.parse(REQUEST)  # 4 x 4 patches: gloo gathers equal shares only
        fits = REQUEST | {"width": 48}
        with pytest.raises(RequestValidationError, match=r"step_cache.*not with sequence parallel"):
            runner.parse(fits | {"step_cache": "first_block:0.2"})
        assert runner.run([runner.parse(fits | {"step_cache": "off"})])[0].shape == (32, 48, 3)
        worker = runner.sequence_parallel.workers[1]
        worker.kill()
        worker.join()
        with pytest.raises(RuntimeError, match="sequence parallel: the worker of rank 2 on cpu exited"):
            runner.submit(runner.parse(fits)).result()
    finally:
        runner.close()  # returns with a worker gone


def test_what_sequence_parallel_does_not_combine_with_is_refused_by_name():
    for clash, message in (({"step_cache": "first_block:0.2"}, "a step cache"), ({"cfg_device": "cpu"},
                           "CFG parallel"), ({"compile": "blocks"}, "compile 'blocks'")):
        with pytest.raises(ValueError, match=f"sequence parallel does not combine with {message}"):
            DiffusionRunnerConfig(MODEL, batching="step", sp_devices=("cpu",), **clash)
    with pytest.raises(ValueError, match="the stable_diffusion family does not take sequence parallel"):
        DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", sp_devices=("cpu",)))
    with pytest.raises(ValueError, match="has 2 attention heads, and each device takes at least one"):
        DiffusionRunner(DiffusionRunnerConfig("demo:tiny-z-image", sp_devices=("cpu", "cpu")))


@pytest.mark.parametrize(("kind", "params", "expected"), [
    ("MODEL", {"gpus": "0,1,2"}, {"device": "cuda:0", "sp_devices": ("cuda:1", "cuda:2")}),
    ("CPU", {}, {"device": "cpu", "sp_devices": ("cpu",)}),
    ("CPU", {"sp_ranks": "3"}, {"device": "cpu", "sp_devices": ("cpu", "cpu")}),
])
def test_parallel_sp_places_rank_zero_first(kind, params, expected):
    config = {"parameters": {key: {"string_value": value} for key, value in (params | {"parallel": "sp"}).items()}}
    runner, _ = runner_config(config, {"model_instance_kind": kind})
    assert {"device": runner.device, "sp_devices": runner.sp_devices} == expected


@pytest.mark.parametrize(("kind", "params", "message"), [
    ("MODEL", {"gpus": "0"}, "two GPUs or more"), ("GPU", {"gpus": "0,1"}, "KIND_MODEL"),
    ("CPU", {"sp_ranks": "1"}, "sp_ranks must be at least 2"),
])
def test_parallel_sp_is_refused_where_it_cannot_run(kind, params, message):
    config = {"parameters": {key: {"string_value": value} for key, value in (params | {"parallel": "sp"}).items()}}
    with pytest.raises(ValueError, match=message):
        runner_config(config, {"model_instance_kind": kind, "model_instance_device_id": "0"})
