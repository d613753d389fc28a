"""Qwen2.5-Omni's thinker sees the prompt's images through ``ar`` as the model does: its processor's
patch grid and widened markers, its vision tower's embeddings, its multimodal rotary positions (the
image's tokens at their rows and columns, the text after them shifted), and, on the transformers
engine, ``thinker.generate``'s reply token for token; another image moves it. The reference is the
model's processor (tests/support/qwen25.processor) and the whole model's ``thinker.generate``."""

from __future__ import annotations

import copy
import uuid

import pytest
import torch
from transformers import DynamicCache, Qwen2_5OmniForConditionalGeneration
from triton_omni.ar import ArLimits, ArRunner, ArRunnerConfig, GenerateRequest
from triton_omni.ar.batching import _rotary_at
from triton_omni.ar.vision_prompt import ThinkerEyes
from triton_omni.demo_models import resolve_model
from triton_omni.errors import RequestValidationError

from tests.support.heard import as_heard, tone, wav_bytes
from tests.support.qwen25 import noise, png, processor, user_turn

DEMO = "demo:tiny-qwen2.5-omni"
REPLY_TOKENS = 8


IMAGES = (noise(84, 112, 0), noise(56, 140, 1))  # two patch grids: 6 x 8 and 4 x 10


@pytest.fixture(scope="module")
def demo():
    folder = resolve_model(DEMO)
    return processor(folder), Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def runner():
    runner = ArRunner(ArRunnerConfig(model=DEMO, engine="transformers", max_model_len=1024))
    yield runner
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
    runner.check(request)
    responses = []

    async def run():
        async for response in runner.generate(request, uuid.uuid4().hex):
            responses.append(response)

    runner.loop.run(run(), timeout=120)
    return [token for response in responses for token in response.token_ids[0]]


def test_the_prompt_and_its_positions_are_the_processor_s_and_the_thinker_s(demo):
    """Two images of different grids: each marker widened to its image's tokens, the embeddings the
    thinker's own forward reads (its vision tower's in the markers' places), and the rotary positions
    its ``get_rope_index`` gives (rows and columns at the images, the text after them shifted)."""
    made, model = demo
    eyes = ThinkerEyes(resolve_model(DEMO), torch.device("cpu"), torch.float32)
    text = user_turn(made.tokenizer, "What is this?", 0, images=2)
    ids, embeds, grid = eyes.prompt(made.tokenizer(text)["input_ids"], None, list(IMAGES))
    inputs = made(text=text, images=list(IMAGES), return_tensors="pt")
    assert ids == inputs["input_ids"][0].tolist() and grid.tolist() == inputs["image_grid_thw"].tolist()
    with torch.no_grad():
        read = model.thinker(**inputs, output_hidden_states=True).hidden_states[0][0]
    assert embeds.shape == read.shape and float((embeds - read).abs().max()) < 1e-6
    positions, delta = model.thinker.get_rope_index(inputs["input_ids"], inputs["image_grid_thw"], None,
                                                    inputs["attention_mask"])
    mine = eyes.positions(ids, grid, None)
    assert torch.equal(mine.positions, positions[:, 0]) and mine.delta == int(delta) < 0
    assert not torch.equal(mine.positions[1], mine.positions[2])  # rows and columns: not one position


def test_the_transformers_engine_answers_images_as_the_thinker_does_and_another_image_moves_it(demo, runner):
    made, model = demo
    text = user_turn(made.tokenizer, "What is this?", 0, images=1)
    reply = served(runner, text, IMAGES[:1])
    assert reply == expected_reply(model, made(text=text, images=list(IMAGES[:1]), return_tensors="pt"))
    assert served(runner, text, [noise(84, 112, 7)]) != reply


def test_images_and_audio_in_one_prompt_are_answered_as_the_thinker_does(demo, runner):
    made, model = demo
    clips = (tone(2.0, 440), tone(1.3, 220, seed=1))
    text = user_turn(made.tokenizer, "What is this?", 2, images=2)
    inputs = made(text=text, images=list(IMAGES), audio=[as_heard(clip) for clip in clips], return_tensors="pt")
    assert served(runner, text, IMAGES, clips) == expected_reply(model, inputs)


def test_the_positions_are_the_thinker_s_and_plain_ones_would_read_otherwise(demo, runner):
    """The tiny thinker's greedy reply barely depends on positions, so the check is on the logits: the
    engine's LM at the image's positions gives the thinker's own, in the prefill and in a decode step
    at the token's index shifted by the prompt's ``delta``; at plain positions (every section at the
    token's index, as a text prompt is read) logits far past that tolerance."""
    made, model = demo
    text = user_turn(made.tokenizer, "What is this?", 0, images=1)
    inputs = made(text=text, images=list(IMAGES[:1]), return_tensors="pt")
    ids, embeds, grid = runner.eyes.prompt(made.tokenizer(text)["input_ids"], None, list(IMAGES[:1]))
    positions = runner.eyes.positions(ids, grid, None)
    lm, token, tolerance = runner.engine.model, 42, 1e-6
    longer = inputs | {"input_ids": torch.tensor([[*ids, token]]), "attention_mask": torch.ones(1, len(ids) + 1)}
    with torch.no_grad():
        expected, expected_next = model.thinker(**inputs).logits[0], model.thinker(**longer).logits[0, -1]
        cache = DynamicCache()
        with _rotary_at(lm, positions):
            mine = lm(inputs_embeds=embeds[None], past_key_values=cache, use_cache=True).logits[0]
        plain_cache = DynamicCache()
        plain = lm(inputs_embeds=embeds[None], past_key_values=plain_cache, use_cache=True).logits[0]
        step = {"input_ids": torch.tensor([[token]]), "use_cache": True}
        plain_next = lm(**step, past_key_values=copy.deepcopy(cache), position_ids=torch.tensor([[len(ids)]]))
        mine_next = lm(**step, past_key_values=cache, position_ids=torch.tensor([[len(ids) + positions.delta]]))
    assert float((mine - expected).abs().max()) < tolerance
    assert float((mine_next.logits[0, -1] - expected_next).abs().max()) < tolerance
    assert float((plain - expected).abs().max()) > 1000 * tolerance
    assert float((plain_next.logits[0, -1] - expected_next).abs().max()) > 100 * tolerance


def test_images_the_prompt_does_not_mark_and_states_for_a_talker_are_refused_by_name(demo, runner):
    made, _ = demo
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
