"""``compile: blocks``: each repeated block of a diffusion transformer
compiled with torch.compile (regional compilation), on the CPU with the tiny
random-weight DiTs and torch's own inductor; ``compile: blocks,vae``: the VAE's
decoder too. Both are compiled in place, so the step engine, the step cache's
hooks and the pipeline all run them; the images stay within float32 rounding
of the eager ones, and the same requests again compile nothing (the runner's
``on_compile``, the stage's ``omni_diffusion_compiles_total``). A family
without diffusion-transformer blocks, one whose VAE is not compiled and a
malformed value are refused at load."""

from __future__ import annotations

import pytest
import torch
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion import runner as runner_module

FAMILIES = {"qwen_image": "demo:tiny-qwen-image", "z_image": "demo:tiny-z-image",
            "flux2_klein": "demo:tiny-flux2-klein", "wan": "demo:tiny-wan"}
DEFAULTS = {"wan": {"num_frames": 5}}  # a video's frame count
REQUEST = {"prompt": "a red fox", "negative_prompt": "blurry", "num_inference_steps": 4, "guidance_scale": 4.0,
           "height": 32, "width": 32, "seed": 3}


def images(model: str, compile: str, requests: list[dict], defaults: dict | None = None) -> list[torch.Tensor]:
    compiles: list[float] = []  # the seconds of each compilation (the stage's omni_diffusion_compiles_total)
    runner = DiffusionRunner(DiffusionRunnerConfig(model, batching="step", exact_batching=False, compile=compile,
                                                   defaults=defaults or {}), on_compile=compiles.append)

    def run() -> list[torch.Tensor]:
        parsed = [runner.parse(r) for r in requests]
        # admitted at one step, as Triton's batch is: the same batches both times, whatever the host's load
        # (a request joining a step later meets a batch size the first run never compiled)
        with runner.steps.together():
            futures = [runner.submit(r) for r in parsed]
        return [f.result() for f in futures]

    try:
        done = run()
        assert hasattr(runner.pipeline.vae.decoder.forward, "_torchdynamo_orig_callable") == ("vae" in compile)
        assert runner.steps.fixed_shapes == ("blocks" in compile)  # compiled: steps padded to a few sizes
        assert bool(compiles) == (compile != "off") and all(seconds > 0 for seconds in compiles), compiles
        warm = len(compiles)
        again = run()  # the same requests: every shape met, nothing compiles again
        assert len(compiles) == warm, f"{len(compiles) - warm} compilations on shapes already met"
        assert all(torch.equal(a, b) for a, b in zip(done, again, strict=True))
        return done
    finally:
        runner.close()


def compiled_blocks(runner: DiffusionRunner) -> int:
    return sum(hasattr(m.forward, "_torchdynamo_orig_callable") for m in runner.pipeline.transformer.modules())


# Sizes that change are dynamic from the first compile (as on a server after its second shape): one compile
# per block kind instead of one per shape keeps this file inside a minute on two cores.
DYNAMIC = {"dynamic": True}


# Z-Image's VAE decoder (an AutoencoderKL, as FLUX.1's) compiles here too: the same torch.compile of the
# decoder's forward as FLUX.2's, whose own compile took 100 s of this file's 4 minutes on two cores
# (benchmarks/families.py --compile blocks,vae compiles FLUX.2's on a GPU, its image's PSNR printed)
COMPILED = {"qwen_image": "blocks", "z_image": "blocks,vae", "flux2_klein": "blocks", "wan": "blocks"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_blocks_give_the_eager_images_in_company_and_with_the_step_cache(family, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(runner_module, "COMPILE_OPTIONS", DYNAMIC)
    requests = [REQUEST, REQUEST | {"seed": 4, "num_inference_steps": 3},
                REQUEST | {"seed": 5, "step_cache": "first_block:0.6"}]
    eager = images(FAMILIES[family], "off", requests, DEFAULTS.get(family))
    compiled = images(FAMILIES[family], COMPILED[family], requests, DEFAULTS.get(family))
    for e, c in zip(eager, compiled, strict=True):
        assert e.shape == c.shape
        assert int((e.int() - c.int()).abs().max()) <= 1  # inductor's fused float32 rounding, at most one level


def test_compile_puts_every_repeated_block_under_torch_compile():
    runner = DiffusionRunner(DiffusionRunnerConfig(FAMILIES["qwen_image"], compile="blocks"))
    try:
        blocks = runner.pipeline.transformer.transformer_blocks
        assert compiled_blocks(runner) == len(blocks) > 0
    finally:
        runner.close()


def test_compile_is_refused_for_a_unet_and_for_an_unknown_mode():
    with pytest.raises(ValueError, match="compile 'blocks': the stable_diffusion family has no diffusion"):
        DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", compile="blocks"))
    with pytest.raises(ValueError, match="compile 'blocks,vae': the qwen_image family's VAE is not compiled"):
        DiffusionRunner(DiffusionRunnerConfig(FAMILIES["qwen_image"], compile="blocks,vae"))
    for wrong in ("full", "blocks,full", ","):
        with pytest.raises(ValueError, match=f"compile must be off or one or more of blocks, vae .*got '{wrong}'"):
            DiffusionRunnerConfig("demo:tiny-qwen-image", compile=wrong)


def test_compiled_blocks_with_cfg_parallel_give_the_eager_images(monkeypatch):
    """CFG parallel's worker compiles its copy of the blocks as the runner does its own."""
    torch._dynamo.reset()
    monkeypatch.setattr(runner_module, "COMPILE_OPTIONS", DYNAMIC)
    requests = [REQUEST, REQUEST | {"seed": 4, "num_inference_steps": 3, "negative_prompt": "dark and blurry"},
                REQUEST | {"seed": 5, "height": 48}]
    eager = images(FAMILIES["qwen_image"], "off", requests)
    runner = DiffusionRunner(DiffusionRunnerConfig(FAMILIES["qwen_image"], batching="step", exact_batching=False,
                                                   compile="blocks", cfg_device="cpu"))
    try:
        compiled = [f.result() for f in [runner.submit(runner.parse(r)) for r in requests]]
    finally:
        runner.close()
    for e, c in zip(eager, compiled, strict=True):
        assert int((e.int() - c.int()).abs().max()) <= 1


def test_a_compile_watch_closes_after_torch_forgot_its_callbacks():
    """``torch._dynamo.reset()`` (a runner's release, a benchmark's next way) clears dynamo's
    callbacks: closing a watch after it must not raise, and a new watch counts again."""
    seen: list[float] = []
    stale = runner_module.CompileWatch(seen.append)
    torch._dynamo.reset()
    stale.close()
    watch = runner_module.CompileWatch(seen.append)
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    finally:
        watch.close()
    assert len(seen) == 1 and seen[0] > 0
