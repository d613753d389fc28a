"""CFG parallel's code path on the CPU (tiny Qwen-Image, FLUX.2 [klein] and Wan 2.2 T2V-A14B, whose
worker holds both experts): the negatives' pass on a copy of the transformer, in a worker process
over gloo, gives the image
the runner gives without it, alone and beside requests with other steps, guidance
and step caches. The second device here is the CPU again: tests/gpu runs it
over two GPUs, and benchmarks/parallel.py measures it."""

from __future__ import annotations

import pytest
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig

from tests.support import fake_pb_utils

fake_pb_utils.install()
from triton_omni.triton.diffusion_io import runner_config  # noqa: E402  (after the stand-in for pb_utils)

MODEL = "demo:tiny-qwen-image"
REQUEST = {"prompt": "a red fox", "negative_prompt": "blurry", "num_inference_steps": 6, "guidance_scale": 4.0,
           "height": 32, "width": 32, "seed": 3}
COMPANY = [REQUEST, REQUEST | {"seed": 5, "num_inference_steps": 9}, REQUEST | {"seed": 7, "guidance_scale": 1.0},
           REQUEST | {"seed": 9, "step_cache": "first_block:0.4"}]


def images(runner: DiffusionRunner, requests: list[dict]) -> list:
    futures = [runner.submit(runner.parse(values)) for values in requests]
    return [future.result() for future in futures]


@pytest.mark.parametrize(("model", "defaults"), [(MODEL, {}), ("demo:tiny-flux2-klein", {}),
                                                 ("demo:tiny-wan2.2-a14b", {"num_frames": 5})])
def test_cfg_parallel_gives_the_one_device_images(model, defaults):
    one = DiffusionRunner(DiffusionRunnerConfig(model, batching="step", defaults=defaults))
    try:
        expected = [images(one, [values])[0] for values in COMPANY] + images(one, COMPANY)
    finally:
        one.close()
    parallel = DiffusionRunner(DiffusionRunnerConfig(model, batching="step", cfg_device="cpu", defaults=defaults))
    try:
        assert parallel.cfg_parallel.workers[0].is_alive()
        got = [images(parallel, [values])[0] for values in COMPANY] + images(parallel, COMPANY)
    finally:
        parallel.close()
    for image, reference in zip(got, expected, strict=True):
        assert (image.int() - reference.int()).abs().max() == 0


def test_cfg_parallel_counts_the_steps_the_step_cache_skipped_as_one_device_does():
    # the negatives' cache states live in the worker, which tells rank 0 each pass's decision
    counts = {}
    for device in (None, "cpu"):
        runner = DiffusionRunner(DiffusionRunnerConfig(MODEL, batching="step", cfg_device=device))
        try:
            reported = []
            runner.submit(runner.parse(COMPANY[3]), on_cached=lambda *c, r=reported: r.append(c)).result()
            counts[device] = reported
        finally:
            runner.close()
    assert counts[None] == counts["cpu"] and counts[None][0][1] > 0


def test_a_dead_worker_fails_guided_requests_by_name_and_unguided_ones_still_run():
    runner = DiffusionRunner(DiffusionRunnerConfig(MODEL, batching="step", cfg_device="cpu"))
    try:
        worker = runner.cfg_parallel.workers[0]
        worker.kill()
        worker.join()
        with pytest.raises(RuntimeError, match="CFG parallel: the worker of rank 1 on cpu exited"):
            runner.submit(runner.parse(REQUEST)).result()
        unguided = runner.submit(runner.parse(REQUEST | {"guidance_scale": 1.0})).result()
        assert unguided.shape == (32, 32, 3)
    finally:
        runner.close()  # returns with the worker gone


def test_cfg_parallel_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match=r"CFG parallel.*batching 'step'"):
        DiffusionRunnerConfig(MODEL, batching="request", cfg_device="cpu")
    with pytest.raises(ValueError, match=r"the z_image family does not \(families that do: qwen_image, "
                                         r"qwen_image_edit, qwen_image_edit_plus, flux2_klein, wan, wan2.2_ti2v, "
                                         r"wan2.2_a14b, wan2.2_i2v_a14b\)"):
        DiffusionRunner(DiffusionRunnerConfig("demo:tiny-z-image", batching="step", cfg_device="cpu"))
    with pytest.raises(ValueError, match=r"the flux1 family does not"):  # guidance-distilled: one pass a step
        DiffusionRunner(DiffusionRunnerConfig("demo:tiny-flux1-dev", batching="step", cfg_device="cpu"))


@pytest.mark.parametrize(("kind", "gpus", "message"), [
    ("MODEL", "0", "two GPUs"), ("MODEL", "0,1,2", "two GPUs"), ("GPU", "0,1", "KIND_MODEL"),
])
def test_parallel_cfg_needs_one_model_instance_over_two_gpus(kind, gpus, message):
    config = {"max_batch_size": 4, "parameters": {"parallel": {"string_value": "cfg"},
                                                  "gpus": {"string_value": gpus},
                                                  "batching": {"string_value": "step"}}}
    with pytest.raises(ValueError, match=message):
        runner_config(config, {"model_instance_kind": kind, "model_instance_device_id": "0"})


def test_an_unknown_parallel_mode_fails_the_load_by_name():
    config = {"parameters": {"parallel": {"string_value": "sequence"}}}
    with pytest.raises(ValueError, match="model parameter parallel must be"):
        runner_config(config, {"model_instance_kind": "CPU"})
