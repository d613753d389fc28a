"""Qwen2.5-Omni's and Qwen3-Omni's thinkers see the prompt's images through ``ar`` as the models do:
the processor's patch grid and widened markers, the vision tower's embeddings, the multimodal rotary
positions (the image's tokens at their rows and columns, the text after them shifted; Qwen3-Omni's
sections interleaved), Qwen3-Omni's deepstack features, and, on the transformers engine,
``thinker.generate``'s reply token for token; another image moves it. The reference is each model's
processor (tests/support/qwen25.processor, tests/support/heard.model) and ``thinker.generate``."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import DynamicCache, Qwen2_5OmniForConditionalGeneration
from triton_omni.ar import ArLimits, ArRunner, ArRunnerConfig, GenerateRequest
from triton_omni.ar.batching import _seeing
from triton_omni.ar.vision_prompt import eyes_of
from triton_omni.demo_models import resolve_model
from triton_omni.errors import RequestValidationError

from tests.support import heard
from tests.support.ar_runner import responses as run_to_end
from tests.support.heard import as_heard, tone, wav_bytes
from tests.support.qwen25 import noise, png, processor, user_turn

REPLY_TOKENS = 8
IMAGES = (noise(84, 112, 0), noise(56, 140, 1))  # two patch grids of each model's


@pytest.fixture(scope="module", params=["qwen2.5-omni", "qwen3-omni"])
def demo(request):
    """(the demo, its processor, the whole model, ``ar`` on the transformers engine)."""
    name = f"demo:tiny-{request.param}"
    if request.param == "qwen3-omni":
        _, made, model = heard.model()
    else:
        folder = resolve_model(name)
        made, model = processor(folder), Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()
    runner = ArRunner(ArRunnerConfig(model=name, engine="transformers", max_model_len=1024))
    yield name, made, model, runner
    runner.close()


def expected_reply(model, inputs) -> list[int]:
    with torch.no_grad():
        out = model.thinker.generate(**inputs, max_new_tokens=REPLY_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def served(runner: ArRunner, text: str, images, clips=()) -> list[int]:
    """``ar``'s greedy reply ids to ``text`` with ``images`` (sent as PNG files) and ``clips``."""
    inputs = {"text_input": text, "images": [png(image) for image in images], "max_tokens": REPLY_TOKENS,
              "temperature": 0.0, "return_token_ids": True}
    if clips:
        inputs["input_audio"] = [wav_bytes(clip) for clip in clips]
    request = GenerateRequest.from_inputs(inputs, ArLimits(), audio=runner.audio_limits, images=runner.image_limits)
    responses = run_to_end(runner, request)
    return [token for response in responses for token in response.token_ids[0]]


def test_the_prompt_and_its_positions_are_the_processor_s_and_the_thinker_s(demo):
    """Two images of different grids: each marker widened to its image's tokens, the embeddings the
    thinker's own forward reads (its vision tower's in the markers' places), and the rotary positions
    its ``get_rope_index`` gives (rows and columns at the images, the text after them shifted)."""
    name, made, model, _ = demo
    eyes = eyes_of(resolve_model(name), torch.device("cpu"), torch.float32)
    text = user_turn(made.tokenizer, "What is this?", 0, images=2)
    seen = eyes.prompt(made.tokenizer(text)["input_ids"], None, list(IMAGES))
    inputs = made(text=text, images=list(IMAGES), return_tensors="pt")
    assert seen.ids == inputs["input_ids"][0].tolist() and torch.equal(seen.grid, inputs["image_grid_thw"])
    with torch.no_grad():
        read = model.thinker(**inputs, output_hidden_states=True).hidden_states[0][0]
    assert seen.embeds.shape == read.shape and float((seen.embeds - read).abs().max()) < 1e-6
    positions, delta = model.thinker.get_rope_index(inputs["input_ids"], inputs["image_grid_thw"], None,
                                                    inputs["attention_mask"])
    mine = eyes.inputs(seen, None)
    assert torch.equal(mine.positions, positions[:, 0]) and mine.delta == int(delta) < 0
    assert not torch.equal(mine.positions[1], mine.positions[2])  # rows and columns: not one position


def test_the_transformers_engine_answers_images_as_the_thinker_does_and_another_image_moves_it(demo):
    _, made, model, runner = demo
    text = user_turn(made.tokenizer, "What is this?", 0, images=1)
    reply = served(runner, text, IMAGES[:1])
    assert reply == expected_reply(model, made(text=text, images=list(IMAGES[:1]), return_tensors="pt"))
    assert served(runner, text, [noise(84, 112, 7)]) != reply


def test_images_and_audio_in_one_prompt_are_answered_as_the_thinker_does(demo):
    _, made, model, runner = demo
    clips = (tone(2.0, 440), tone(1.3, 220, seed=1))
    text = user_turn(made.tokenizer, "What is this?", 2, images=2)
    inputs = made(text=text, images=list(IMAGES), audio=[as_heard(clip) for clip in clips], return_tensors="pt")
    assert served(runner, text, IMAGES, clips) == expected_reply(model, inputs)


def test_the_lm_reads_the_images_as_the_thinker_does_and_would_read_otherwise_without_it(demo):
    """The tiny thinker's greedy reply barely depends on positions, so the check is on the logits: the
    engine's LM at the image's positions (with Qwen3-Omni's deepstack features) gives the thinker's
    own, in the prefill and in a decode step at the token's index shifted by the prompt's ``delta``;
    at plain positions (every section at the token's index, as a text prompt is read), or without the
    deepstack features, logits far past that tolerance."""
    _, made, model, runner = demo
    text = user_turn(made.tokenizer, "What is this?", 0, images=1)
    inputs = made(text=text, images=list(IMAGES[:1]), return_tensors="pt")
    seen = runner.eyes.prompt(made.tokenizer(text)["input_ids"], None, list(IMAGES[:1]))
    vision, ids = runner.eyes.inputs(seen, None), seen.ids
    lm, token, tolerance = runner.engine.model, 42, 1e-5
    longer = inputs | {"input_ids": torch.tensor([[*ids, token]]), "attention_mask": torch.ones(1, len(ids) + 1)}

    def prefill(reading):
        cache = DynamicCache()
        with _seeing(lm, reading):
            return lm(inputs_embeds=seen.embeds[None], past_key_values=cache, use_cache=True).logits[0], cache

    with torch.no_grad():
        expected, expected_next = model.thinker(**inputs).logits[0], model.thinker(**longer).logits[0, -1]
        mine, cache = prefill(vision)
        plain, _ = prefill(None)
        step = {"input_ids": torch.tensor([[token]]), "use_cache": True}
        plain_next = lm(**step, past_key_values=copy.deepcopy(cache), position_ids=torch.tensor([[len(ids)]]))
        mine_next = lm(**step, past_key_values=cache, position_ids=torch.tensor([[len(ids) + vision.delta]]))
        if vision.deepstack:
            unstacked, _ = prefill(dataclasses.replace(vision, deepstack=()))
            assert float((unstacked - expected).abs().max()) > 100 * tolerance
    assert float((mine - expected).abs().max()) < tolerance
    assert float((mine_next.logits[0, -1] - expected_next).abs().max()) < tolerance
    assert float((plain - expected).abs().max()) > 100 * tolerance
    assert float((plain_next.logits[0, -1] - expected_next).abs().max()) > 10 * tolerance


def test_images_the_prompt_does_not_mark_and_states_for_a_talker_are_refused_by_name(demo):
    _, made, _, runner = demo
    with pytest.raises(RequestValidationError, match="1 image markers") as error:
        served(runner, user_turn(made.tokenizer, "What is this?", 0, images=1), IMAGES)
    assert error.value.parameter == "images"
    request = GenerateRequest.from_inputs(
        {"text_input": "hi", "images": [png(IMAGES[0])], "return_thinker_states": True}, ArLimits(),
        images=runner.image_limits)
    with pytest.raises(RequestValidationError) as error:
        runner.check(request)
    assert error.value.parameter == "return_thinker_states"
    with pytest.raises(RequestValidationError, match="takes no input image") as error:
        GenerateRequest.from_inputs({"text_input": "hi", "images": [png(IMAGES[0])]}, ArLimits())
    assert error.value.parameter == "images"


def test_the_vllm_engine_refuses_images_by_name():
    """vLLM is handed the thinker's language model alone, which knows no image positions."""
    from triton_omni.ar.engine_vllm import VllmEngine

    with pytest.raises(RequestValidationError, match="engine: transformers") as error:
        VllmEngine.check_images(object.__new__(VllmEngine), "images")
    assert error.value.parameter == "images"
