"""Step caching per request at real shapes (random weights, bf16) on a GPU:
a cached request step-batched beside others (cached or not, other steps and
seeds) against the same request alone with the same method. Alone the cache
takes the decisions it takes; in company its rows run in smaller batches,
whose bf16 kernels differ in the low bits, and the test states how far that
carries (printed), as test_model_families does for the uncached engine.
GPU only (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from triton_omni.diffusion import DiffusionRunner

# the same runners and company tolerance (levels of 255 per pixel channel, max and mean) as the uncached engine's
from tests.gpu.test_model_families import COMPANY_MEAN_TOLERANCE, COMPANY_TOLERANCE, step  # noqa: F401

SIZE = 512
STEPS = {"qwen_image": 20, "z_image": 8}  # enough steps that the method skips some (changes shrink with more)
# Thresholds at which these random-weight DiTs skip some steps (benchmarks/step_cache.py)
METHOD = "first_block:1.0"


def values(runner: DiffusionRunner, seed: int, step_cache: str, extra_steps: int = 0) -> dict:
    steps = STEPS[runner.family.name] + extra_steps
    generator = torch.Generator().manual_seed(seed)
    hidden = runner.limits.hidden_size
    guidance = 4.0 if runner.family.name == "qwen_image" else 0.0
    request = {"prompt_embeds": (torch.randn(32, hidden, generator=generator) * 0.5).to(torch.bfloat16),
               "guidance_scale": guidance, "seed": seed, "num_inference_steps": steps, "height": SIZE,
               "width": SIZE, "step_cache": step_cache}
    if guidance:
        request["negative_prompt_embeds"] = (torch.randn(24, hidden, generator=generator) * 0.5).to(torch.bfloat16)
    return request


def run(runner: DiffusionRunner, requests: list[dict]) -> tuple[list[torch.Tensor], list]:
    counts: list = [None] * len(requests)
    futures = [runner.submit(runner.parse(r), on_cached=lambda c, s, i=i: counts.__setitem__(i, (c, s)))
               for i, r in enumerate(requests)]
    return [future.result() for future in futures], counts


# The families whose requests values() builds (a guided or unguided text-to-image request of prompt
# embeddings alone); the edit, FLUX.2 and FLUX.1 take input images or a pooled embedding besides.
@pytest.mark.parametrize("step", [(family, exact) for family in STEPS for exact in ("false", "pipeline")],
                         indirect=True, ids="-".join)
def test_a_cached_request_in_company_is_near_its_image_alone(step):  # noqa: F811  (the imported fixture)
    [alone], [alone_counts] = run(step, [values(step, 1, METHOD)])
    [plain], _ = run(step, [values(step, 1, "off")])
    company, counts = run(step, [values(step, 1, METHOD), values(step, 2, "off"),
                                 values(step, 3, METHOD, extra_steps=3), values(step, 4, METHOD)])
    difference = (company[0].int() - alone.int()).abs()
    print(f"{step.family.name}: alone {alone_counts} (computed, skipped); in company {counts}; against alone: max "
          f"{int(difference.max())}, mean {float(difference.float().mean()):.3f}; cached against uncached alone: "
          f"mean {float((alone.float() - plain.float()).abs().mean()):.3f}")
    assert alone_counts[1] > 0, "the method should skip steps at this threshold"
    assert counts[1] is None and sum(counts[0]) == STEPS[step.family.name]
    assert int(difference.max()) <= COMPANY_TOLERANCE and float(difference.float().mean()) <= COMPANY_MEAN_TOLERANCE
