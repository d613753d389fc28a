"""`ar_encoder`'s recipes give what each diffusion pipeline's own
`encode_prompt` gives for the same weights: the template, the layers (FLUX.2's
three, joined per token), the dropped template tokens, the padding (FLUX.2's
512 tokens, unattended, their states kept) (tiny random-weight models,
float32): on the
transformers engine within 1e-4, on vLLM (Qwen-Image's, through its text
encoder's language model) with a cosine of at least 0.999 per token."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from triton_omni.ar import EncodeRequest
from triton_omni.ar.runner import ArRunner, ArRunnerConfig
from triton_omni.demo_models import resolve_model

PROMPTS = ["a red fox", "a watercolor lighthouse by the sea, at night", "robot"]
CASES = {"qwen_image": "demo:tiny-qwen-image", "z_image": "demo:tiny-z-image", "flux2_klein": "demo:tiny-flux2-klein",
         "flux2_dev": "demo:tiny-flux2-dev", "flux1": "demo:tiny-flux1-dev"}


@functools.cache
def loaded(model: str) -> DiffusionPipeline:
    return DiffusionPipeline.from_pretrained(resolve_model(model))


def pipeline_embeds(model: str, prompt: str) -> torch.Tensor:
    return pipeline_encoding(model, prompt)[0]


def pipeline_encoding(model: str, prompt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pipeline's own encoding of ``prompt``: its sequence, and its pooled embedding (FLUX.1)."""
    pipeline = loaded(model)
    with torch.inference_mode():
        if type(pipeline).__name__ == "FluxPipeline":  # T5's 512 rows, CLIP's pooled vector
            embeds, pooled, _ = pipeline.encode_prompt(prompt=prompt, prompt_2=None, device="cpu")
            return embeds[0], pooled[0]
        return _sequence(pipeline, prompt), None


def _sequence(pipeline, prompt: str) -> torch.Tensor:
    with torch.inference_mode():
        if type(pipeline).__name__ == "QwenImagePipeline":
            embeds, mask = pipeline.encode_prompt(prompt=prompt, device="cpu")
            return embeds[0] if mask is None else embeds[0][mask[0].bool()]
        if type(pipeline).__name__ in ("Flux2KleinPipeline", "Flux2Pipeline"):  # 512 rows, padding's; 3 layers
            return pipeline.encode_prompt(prompt=prompt, device="cpu")[0][0]
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
        expected, pooled = pipeline_encoding(CASES[recipe], prompt)
        assert result.hidden_states.shape == expected.shape, prompt
        assert (result.hidden_states - expected).abs().max() <= 1e-4, prompt
        assert (result.pooled is None) == (pooled is None), prompt
        if pooled is not None:
            assert result.pooled.shape == pooled.shape and (result.pooled - pooled).abs().max() <= 1e-4, prompt


def test_the_negative_side_is_the_pipelines_encoding_of_what_it_was_given(encoder):
    """"" and " " are encoded as the pipeline encodes them; an absent negative prompt gives what the
    pipeline uses without one: Z-Image's encoding of "", or zero tokens for Qwen-Image (no true CFG)."""
    recipe, runner = encoder
    requests = [EncodeRequest("a red fox", negative, with_negative=True) for negative in ("", " ", "blurry", None)]
    results = runner.loop.run(runner.encode(requests))
    for request, result in zip(requests, results, strict=True):
        assert (result.hidden_states - pipeline_embeds(CASES[recipe], "a red fox")).abs().max() <= 1e-4
        if request.negative_prompt is None and runner.recipe.absent_negative is None:  # Qwen-Image, FLUX.1
            assert result.negative_hidden_states.shape == (0, runner.hidden_size)
            continue
        expected = pipeline_embeds(CASES[recipe], request.negative_prompt or "")
        assert result.negative_hidden_states.shape == expected.shape, request
        assert (result.negative_hidden_states - expected).abs().max() <= 1e-4, request


def test_qwen_image_on_vllm_equals_the_pipelines_encoding_per_token(caplog):
    """vLLM runs Qwen-Image's recipe on the language model of its Qwen2.5-VL text encoder."""
    pytest.importorskip("vllm")
    with caplog.at_level(logging.INFO):
        runner = ArRunner(ArRunnerConfig(CASES["qwen_image"], mode="encode", engine="auto", recipe="qwen_image"))
    try:
        assert runner.engine_name == "vllm" and "vLLM encodes with the language model of" in caplog.text
        results = runner.loop.run(runner.encode([EncodeRequest(prompt) for prompt in PROMPTS]))
    finally:
        runner.close()
    for prompt, result in zip(PROMPTS, results, strict=True):
        expected = pipeline_embeds(CASES["qwen_image"], prompt)
        assert result.hidden_states.shape == expected.shape, prompt
        cosine = torch.nn.functional.cosine_similarity(result.hidden_states.float(), expected.float(), dim=-1)
        assert cosine.min() >= 0.999, (prompt, cosine.min())


def test_the_language_model_taken_out_equals_the_vision_language_encoder():
    """The Qwen2 folder vLLM loads gives, under transformers, the text encoder's own last layer."""
    from transformers import AutoModel, AutoTokenizer
    from triton_omni.ar.language_model import language_model

    root = Path(resolve_model(CASES["qwen_image"]))
    folder = language_model(root / "text_encoder", root / "tokenizer")
    assert language_model(root / "text_encoder", root / "tokenizer") == folder  # built once
    ids = AutoTokenizer.from_pretrained(folder)("a red fox", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ours = AutoModel.from_pretrained(folder).eval()(ids).last_hidden_state
        theirs = AutoModel.from_pretrained(root / "text_encoder").eval()(ids).last_hidden_state
    assert (ours - theirs).abs().max() <= 1e-5


def test_auto_engine_takes_transformers_for_a_pipelines_encoder_and_says_so(caplog):
    pytest.importorskip("vllm")
    with caplog.at_level(logging.WARNING):
        runner = ArRunner(ArRunnerConfig("demo:tiny-z-image", mode="encode", engine="auto", recipe="z_image"))
    try:
        assert runner.engine_name == "transformers"
        assert "recipe z_image runs on the transformers engine" in caplog.text
    finally:
        runner.close()


@pytest.mark.parametrize(("recipe", "reason"), [("z_image", "it needs hidden layers -2"),
                                              ("flux2_klein", "it needs hidden layers 9, 18, 27"),
                                              ("flux1", "its text encoders are not one causal LM: it runs "
                                                        "the pipeline's own encode_prompt"),
                                              ("qwen_image_edit", "it reads the input image with the prompt \\(the "
                                                                  "vision tower\\)")])
def test_a_recipe_vllm_cannot_run_is_refused_on_vllm_by_name(recipe, reason):
    """(Qwen-Image-Edit's recipe: test_image_edits.py.)"""
    model = CASES.get(recipe, "demo:tiny-qwen-image-edit")
    with pytest.raises(ValueError, match=f"recipe '{recipe}' cannot run on vLLM \\({reason}"):
        ArRunner(ArRunnerConfig(model, mode="encode", engine="vllm", recipe=recipe))


@pytest.mark.parametrize("recipe", ["flux2_klein", "flux1"])
def test_a_prompt_longer_than_the_pipelines_padded_length_is_refused_by_name(recipe):
    """FLUX's pipelines cut a prompt at 512 tokens (FLUX.1: of T5's); ar_encoder refuses it instead,
    naming it."""
    runner = ArRunner(ArRunnerConfig(CASES[recipe], mode="encode", engine="transformers", recipe=recipe))
    try:
        [result] = runner.loop.run(runner.encode([EncodeRequest("fox " * 600)]))
        assert "at most 512" in str(result) and result.parameter == "text_input"
    finally:
        runner.close()


def test_an_unknown_recipe_fails_the_load_by_name():
    with pytest.raises(ValueError, match="recipe must be one of"):
        ArRunnerConfig("demo:tiny-qwen2", mode="encode", recipe="flux")
