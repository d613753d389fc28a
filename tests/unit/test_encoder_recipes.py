"""`ar_encoder`'s recipes give what each diffusion pipeline's own
`encode_prompt` gives for the same weights: the template, the layer, the
dropped template tokens (tiny random-weight models, float32, transformers engine)."""

from __future__ import annotations

import logging

import pytest
import torch
from diffusers import DiffusionPipeline
from triton_omni.ar import EncodeRequest
from triton_omni.ar.runner import ArRunner, ArRunnerConfig
from triton_omni.demo_models import resolve_model

PROMPTS = ["a red fox", "a watercolor lighthouse by the sea, at night", "robot"]
CASES = {"qwen_image": "demo:tiny-qwen-image", "z_image": "demo:tiny-z-image"}


def pipeline_embeds(model: str, prompt: str) -> torch.Tensor:
    pipeline = DiffusionPipeline.from_pretrained(resolve_model(model))
    with torch.inference_mode():
        if type(pipeline).__name__ == "QwenImagePipeline":
            embeds, mask = pipeline.encode_prompt(prompt=prompt, device="cpu")
            return embeds[0] if mask is None else embeds[0][mask[0].bool()]
        [embeds], _ = pipeline.encode_prompt(prompt=prompt, device="cpu", do_classifier_free_guidance=False)
        return embeds


@pytest.fixture(scope="module", params=list(CASES))
def encoder(request):
    runner = ArRunner(ArRunnerConfig(CASES[request.param], mode="encode", engine="transformers",
                                     recipe=request.param))
    yield request.param, runner
    runner.close()


def test_a_batch_of_prompts_equals_the_pipelines_encoding(encoder):
    recipe, runner = encoder
    results = runner.loop.run(runner.encode([EncodeRequest(prompt) for prompt in PROMPTS]))
    for prompt, result in zip(PROMPTS, results, strict=True):
        expected = pipeline_embeds(CASES[recipe], prompt)
        assert result.hidden_states.shape == expected.shape, prompt
        assert (result.hidden_states - expected).abs().max() <= 1e-4, prompt


def test_auto_engine_takes_transformers_for_a_pipelines_encoder_and_says_so(caplog):
    pytest.importorskip("vllm")
    with caplog.at_level(logging.WARNING):
        runner = ArRunner(ArRunnerConfig("demo:tiny-z-image", mode="encode", engine="auto", recipe="z_image"))
    try:
        assert runner.engine_name == "transformers"
        assert "recipe z_image runs on the transformers engine" in caplog.text
    finally:
        runner.close()


def test_a_recipe_vllm_cannot_run_is_refused_on_vllm_by_name():
    with pytest.raises(ValueError, match="recipe 'z_image' cannot run on vLLM"):
        ArRunner(ArRunnerConfig("demo:tiny-z-image", mode="encode", engine="vllm", recipe="z_image"))


def test_an_unknown_recipe_fails_the_load_by_name():
    with pytest.raises(ValueError, match="recipe must be one of"):
        ArRunnerConfig("demo:tiny-qwen2", mode="encode", recipe="flux")
