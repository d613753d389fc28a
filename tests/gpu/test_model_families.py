"""Qwen-Image and Z-Image at their real shapes (random weights, built on the
GPU in bf16) on a GPU: a request's image through step batching, alone and
beside requests of other steps, sizes and guidance, and through request
batching, against the pipeline's own call with the same embeddings and
seeded generator. GPU only (docs/gpu.md); the differences are printed."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion.steps import to_pixels

FAMILIES = {"qwen_image": "demo:realistic-qwen-image", "z_image": "demo:realistic-z-image"}
SIZE, STEPS = 512, 4
TOLERANCE = 1  # per pixel channel, out of 255


@pytest.fixture(scope="module", params=list(FAMILIES))
def runners(request):
    step = DiffusionRunner(DiffusionRunnerConfig(FAMILIES[request.param], device="cuda", dtype="bfloat16",
                                                 batching="step", batch_size=4))
    whole = DiffusionRunner(DiffusionRunnerConfig(FAMILIES[request.param], device="cuda", dtype="bfloat16",
                                                  batching="request", exact_batching=False, batch_size=4))
    yield step, whole
    step.close()
    del step, whole
    torch.cuda.empty_cache()


def embeds(runner: DiffusionRunner, seed: int, tokens: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, runner.limits.hidden_size, generator=generator) * 0.5).to(torch.bfloat16)


def request_values(runner: DiffusionRunner, seed: int, guidance: float, steps: int = STEPS, size: int = SIZE,
                   tokens: int = 32) -> dict:
    values = {"prompt_embeds": embeds(runner, seed, tokens), "guidance_scale": guidance, "seed": seed,
              "num_inference_steps": steps, "height": size, "width": size}
    if guidance > (1.0 if runner.family.name == "qwen_image" else 0.0):
        values["negative_prompt_embeds"] = embeds(runner, seed + 100, tokens - 8)
    return values


def reference(runner: DiffusionRunner, values: dict) -> torch.Tensor:
    qwen = runner.family.name == "qwen_image"
    negative = values.get("negative_prompt_embeds")
    kwargs = {"true_cfg_scale" if qwen else "guidance_scale": values["guidance_scale"]}
    as_input = (lambda e: e[None].cuda()) if qwen else (lambda e: [e.cuda()])
    with torch.inference_mode():
        images = runner.pipeline(
            prompt_embeds=as_input(values["prompt_embeds"]),
            negative_prompt_embeds=None if negative is None else as_input(negative),
            num_inference_steps=values["num_inference_steps"], height=values["height"], width=values["width"],
            generator=torch.Generator("cuda").manual_seed(values["seed"]), output_type="pt", **kwargs).images
    return to_pixels(images)[0]


def difference(image: torch.Tensor, expected: torch.Tensor) -> int:
    return int((image.int() - expected.int()).abs().max())


def test_step_batched_alone_and_in_company(runners):
    step, _ = runners
    guided = 4.0
    company = [request_values(step, 1, guided), request_values(step, 2, 0.0, steps=STEPS + 2),
               request_values(step, 3, guided, size=SIZE // 2), request_values(step, 4, guided, tokens=48)]
    [alone] = step.run([step.parse(company[0])])
    together = step.run([step.parse(values) for values in company])
    diffs = [difference(alone, reference(step, company[0]))] + \
        [difference(image, reference(step, values)) for image, values in zip(together, company, strict=True)]
    print(f"{step.family.name}: step batching against the pipeline, alone then in company: {diffs}")
    assert max(diffs) <= TOLERANCE, diffs


def test_request_batched(runners):
    _, whole = runners
    batch = [request_values(whole, 5, 3.0), request_values(whole, 6, 3.0)]
    images = whole.run([whole.parse(values) for values in batch])
    diffs = [difference(image, reference(whole, values)) for image, values in zip(images, batch, strict=True)]
    print(f"{whole.family.name}: request batching against the pipeline: {diffs}")
    assert max(diffs) <= TOLERANCE, diffs
