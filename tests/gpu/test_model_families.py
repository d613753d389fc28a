"""Qwen-Image, Qwen-Image-Edit, Z-Image, FLUX.2 [klein], FLUX.1 [dev] and Wan 2.1 T2V-1.3B (a video of
``VIDEO_FRAMES`` frames) at their real shapes (random weights, built on the GPU in bf16) on a GPU: a
request's image through step batching against the
pipeline's own call with the same embeddings, seeded generator and (an edit) input image. Alone it
runs the pipeline's batch of one: bit-exact. Beside requests of other steps,
sizes and guidance its forward passes run at other batch sizes, whose bf16
kernels differ in the low bits, and the test states how far that carries
(printed). GPU only (docs/gpu.md)."""

from __future__ import annotations

import gc
import io

import pytest
import torch
from PIL import Image

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion.steps import to_pixels
from triton_omni.families import Guidance
from triton_omni_tools.bench.presets import edit_picture

FAMILIES = {"qwen_image": "demo:realistic-qwen-image", "qwen_image_edit": "demo:realistic-qwen-image-edit",
            "z_image": "demo:realistic-z-image", "flux2_klein": "demo:realistic-flux2-klein",
            "flux1": "demo:realistic-flux1-dev", "wan": "demo:realistic-wan2.1-1.3b",
            "wan2.2_ti2v": "demo:realistic-wan2.2-ti2v-5b", "wan2.2_a14b": "demo:realistic-wan2.2-t2v-a14b"}
# pipelines taking [batch, tokens, hidden]; Z-Image takes a list
STACKED = {"qwen_image", "qwen_image_edit", "flux2_klein", "flux1", "wan", "wan2.2_ti2v", "wan2.2_a14b"}
VIDEOS = {"wan", "wan2.2_ti2v", "wan2.2_a14b"}
VIDEO_FRAMES = 17  # a video family's requests: the model's default set to it, and the pipeline called with it
EDITED = edit_picture(512, 768)  # an edit's input image: the pipeline reads it at about 1024², 3:2
SIZE, STEPS = 512, 4
# Per pixel channel, out of 255, for a request that shares its forward passes with others: bf16
# at these depths carries a kernel's low-bit difference over the steps (an H100 gave up to 4
# levels for Qwen-Image and 11 for Z-Image, means 0.5 and 1.5). A request stepping alone is exact.
COMPANY_TOLERANCE = 16
COMPANY_MEAN_TOLERANCE = 2.0


# exact_batching: "false" shares forward passes; "pipeline" runs each request's passes alone
@pytest.fixture(scope="module", params=[(family, exact) for family in FAMILIES for exact in ("false", "pipeline")],
                ids=lambda p: "-".join(p))
def step(request):
    family, exact = request.param
    # The previous parameter's runner is only unreferenced once pytest drops its cached value, after
    # its teardown: collect it here, or two 38 GiB Qwen-Image DiTs and the Z-Image one meet on one GPU.
    gc.collect()
    torch.cuda.empty_cache()
    runner = DiffusionRunner(DiffusionRunnerConfig(FAMILIES[family], device="cuda", dtype="bfloat16",
                                                   batching="step", batch_size=4, exact_batching=exact,
                                                   defaults={"num_frames": VIDEO_FRAMES} if family in VIDEOS else {}))
    yield runner
    runner.close()


def embeds(runner: DiffusionRunner, seed: int, tokens: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, runner.limits.hidden_size, generator=generator) * 0.5).to(torch.bfloat16)


def request_values(runner: DiffusionRunner, seed: int, guidance: float, steps: int = STEPS, size: int = SIZE,
                   tokens: int = 32) -> dict:
    values = {"prompt_embeds": embeds(runner, seed, tokens), "guidance_scale": guidance, "seed": seed,
              "num_inference_steps": steps, "height": size, "width": size}
    if runner.family.uses_guidance(guidance, has_negative=True):
        values["negative_prompt_embeds"] = embeds(runner, seed + 100, tokens - 8)
    if runner.limits.pooled_size:  # FLUX.1: CLIP's pooled vector
        values["pooled_prompt_embeds"] = embeds(runner, seed + 200, 1)[0, : runner.limits.pooled_size]
    if runner.family.capabilities.edits:
        values["images"] = [EDITED]
    return values


def reference(runner: DiffusionRunner, values: dict) -> torch.Tensor:
    true_cfg = runner.family.capabilities.guidance is Guidance.TRUE_CFG
    negative = values.get("negative_prompt_embeds")
    kwargs = {"true_cfg_scale" if true_cfg else "guidance_scale": values["guidance_scale"]}
    if "images" in values:
        kwargs["image"] = Image.open(io.BytesIO(values["images"][0])).convert("RGB")
    if "pooled_prompt_embeds" in values:
        kwargs["pooled_prompt_embeds"] = values["pooled_prompt_embeds"][None].cuda()
    as_input = (lambda e: e[None].cuda()) if runner.family.name in STACKED else (lambda e: [e.cuda()])
    if runner.output.video:
        kwargs["num_frames"] = VIDEO_FRAMES
    with torch.inference_mode():
        output = runner.pipeline(
            prompt_embeds=as_input(values["prompt_embeds"]),
            negative_prompt_embeds=None if negative is None else as_input(negative),
            num_inference_steps=values["num_inference_steps"], height=values["height"], width=values["width"],
            generator=torch.Generator("cuda").manual_seed(values["seed"]), output_type="pt", **kwargs)
    return to_pixels(runner.family.call_output(output))[0]


def difference(image: torch.Tensor, expected: torch.Tensor) -> int:
    return int((image.int() - expected.int()).abs().max())


def test_step_batched_alone_is_the_pipelines_image(step):
    values = request_values(step, 1, 4.0)
    [image] = step.run([step.parse(values)])
    assert difference(image, reference(step, values)) == 0


def test_step_batched_in_company(step):
    guided = 4.0
    # 1, 5 and 6 share each forward pass (one group: size and token counts); the others step apart
    company = [request_values(step, 1, guided), request_values(step, 2, 0.0, steps=STEPS + 2),
               request_values(step, 3, guided, size=SIZE // 2), request_values(step, 4, guided, tokens=48),
               request_values(step, 5, guided), request_values(step, 6, 2.0, steps=STEPS + 1)]
    together = step.run([step.parse(values) for values in company])
    diffs = [difference(image, reference(step, values)) for image, values in zip(together, company, strict=True)]
    means = [float((image.float() - reference(step, values).float()).abs().mean())
             for image, values in zip(together, company, strict=True)]
    print(f"{step.family.name}, exact_batching {step.config.exact_mode}: in company against the pipeline alone: "
          f"max {diffs}, mean {[f'{m:.3f}' for m in means]}")
    if step.config.exact_mode == "pipeline":  # each request's passes at the pipeline's own batch size
        assert max(diffs) == 0, diffs
    else:
        assert max(diffs) <= COMPANY_TOLERANCE and max(means) <= COMPANY_MEAN_TOLERANCE, (diffs, means)
