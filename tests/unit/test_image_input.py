"""Qwen2.5-Omni's and Qwen3-Omni's thinkers see the prompt's images through ``ar`` as the models do:
the processor's patch grid and widened markers, the vision tower's embeddings, the multimodal rotary
positions (the image's tokens at their rows and columns, the text after them shifted; Qwen3-Omni's
sections interleaved), Qwen3-Omni's deepstack features, and, on the transformers engine,
``thinker.generate``'s reply token for token; another image moves it. The reference is each model's
processor (tests/support/qwen25.processor, tests/support/heard.model) and ``thinker.generate``."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from transformers import DynamicCache, Qwen2_5OmniForConditionalGeneration
from triton_omni.ar import ArLimits, ArRunner, ArRunnerConfig, GenerateRequest
from triton_omni.ar.batching import _seeing
from triton_omni.ar.vision_prompt import eyes_of
from triton_omni.demo_models import resolve_model
from triton_omni.errors import RequestValidationError
from triton_omni.speech.demos import CODEC_EOS, CODEC_PAD

from tests.support import heard
from tests.support.ar_runner import responses as run_to_end
from tests.support.ar_runner import spoken
from tests.support.heard import as_heard, tone, wav_bytes
from tests.support.qwen25 import generate_seen, noise, png, processor, user_turn

REPLY_TOKENS = 8
TALKER_CODES = 16
IMAGES = (noise(84, 112, 0), noise(56, 140, 1))  # two patch grids of each model's


@pytest.fixture(scope="module")
def speech():
    """A speech runner of each demo, made at its first use (``speech(name)``)."""
    from triton_omni.speech.runner import SpeechConfig, SpeechRunner

    made: dict = {}
    yield lambda name: made.get(name) or made.setdefault(name, SpeechRunner(SpeechConfig(model=name)))
    for runner in made.values():
        runner.close()


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


def spoken_reference(name: str, made, model, inputs) -> tuple[list[int], np.ndarray, torch.Tensor | None]:
    """The whole model's ``generate(..., return_audio=True)`` on the processor's ``inputs``, greedy in the
    thinker and the talker (held to ``TALKER_CODES``): the reply's ids, its codes [codebooks, frames]
    and, for Qwen2.5-Omni, the thinker's states it handed its talker [prompt + 2, width]."""
    if "qwen3" in name:
        reply, codes, _ = heard.generate_spoken(inputs, REPLY_TOKENS, TALKER_CODES)
        return reply, codes, None
    # generate hands its talker every input it does not know, the pixels too, which the talker's generate
    # refuses (transformers 5.19); talker_pixel_values=None keeps them from it, the image grids handed on
    reply, seen, _ = generate_seen(model, inputs, "Chelsie", thinker_do_sample=False, talker_pixel_values=None,
                                   thinker_max_new_tokens=REPLY_TOKENS, talker_do_sample=False,
                                   talker_max_new_tokens=TALKER_CODES, talker_min_new_tokens=TALKER_CODES,
                                   talker_eos_token_id=[CODEC_PAD, CODEC_EOS], token2wav_num_steps=2)
    return reply, np.array([seen["codes"]]), seen["inputs_embeds"][0]


def test_a_spoken_reply_to_images_is_the_model_s(demo, speech):
    """``ar`` hands on the prompt as read, with its rotary positions, and the thinker's states (Qwen3-Omni's
    at the images, of its talker's layer; Qwen2.5-Omni's at every token, zeros of the layer-0 input at
    the images); the speech stage given them speaks ``generate``'s codes. A Qwen3-Omni talker numbers
    its own prompt (the user turn and its opening) from the thinker's positions: without them (each
    token at its index, as a text prompt is read) it draws other codes. A Qwen2.5-Omni talker reads
    each token at its index, as ``generate`` runs it, and the thinker's states ``generate`` hands it;
    with the images' embeddings left in (not zeros) they are far from those."""
    name, made, model, runner = demo
    text = user_turn(made.tokenizer, "What is this?", 0, images=2)
    expected_reply, expected_codes, handed = spoken_reference(
        name, made, model, made(text=text, images=list(IMAGES), return_tensors="pt"))
    qwen3 = "qwen3" in name
    request = GenerateRequest.from_inputs(
        {"text_input": text, "images": [png(image) for image in IMAGES], "max_tokens": REPLY_TOKENS,
         "temperature": 0.0, "return_token_ids": True, "return_heard_states": qwen3,
         "return_thinker_states": not qwen3},
        ArLimits(), images=runner.image_limits)
    responses = run_to_end(runner, request)
    prompt_ids, states, positions = responses[0].heard
    reply = [token for response in responses for token in response.token_ids[0]]
    assert reply == expected_reply and positions.shape == (3, len(prompt_ids))
    if not qwen3:
        states = torch.cat([r.thinker_states for r in responses if r.thinker_states is not None])
    inputs = {"text_input": text, "reply_ids": reply, "prompt_ids": prompt_ids,
              "heard_states" if qwen3 else "thinker_states": states, "temperature": 0.0,
              "max_tokens": TALKER_CODES, "min_tokens": TALKER_CODES}
    _, codes = spoken(speech(name), inputs | {"prompt_positions": positions})
    assert np.array_equal(codes, expected_codes)
    if qwen3:
        _, moved = spoken(speech(name), inputs)
        assert not np.array_equal(moved, expected_codes)
        return
    count, tolerance = len(prompt_ids), 1e-5
    assert float((states[:count] - handed[:count]).abs().max()) < tolerance
    at = torch.tensor(prompt_ids) == model.config.thinker_config.image_token_id
    seen = runner.eyes.prompt(made.tokenizer(text)["input_ids"], None, list(IMAGES))
    read = states[:count].clone()
    read[at] += seen.embeds[at]  # the layer-0 input the LM read there
    assert float((read - handed[:count]).abs().max()) > 100 * tolerance


def test_images_the_prompt_does_not_mark_are_refused_by_name(demo):
    _, made, _, runner = demo
    with pytest.raises(RequestValidationError, match="1 image markers") as error:
        served(runner, user_turn(made.tokenizer, "What is this?", 0, images=1), IMAGES)
    assert error.value.parameter == "images"
    with pytest.raises(RequestValidationError, match="takes no input image") as error:
        GenerateRequest.from_inputs({"text_input": "hi", "images": [png(IMAGES[0])]}, ArLimits())
    assert error.value.parameter == "images"


def test_the_vllm_engine_refuses_images_by_name():
    """vLLM is handed the thinker's language model alone, which knows no image positions."""
    from triton_omni.ar.engine_vllm import VllmEngine

    with pytest.raises(RequestValidationError, match="engine: transformers") as error:
        VllmEngine.check_images(object.__new__(VllmEngine), "images")
    assert error.value.parameter == "images"
