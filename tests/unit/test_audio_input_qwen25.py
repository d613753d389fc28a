"""Audio a Qwen2.5-Omni thinker hears (``input_audio``), held to the model's own processor and
``generate(return_audio=True)`` on the tiny demo: the prompt ``ar`` builds (its widened audio markers
and its embeddings) is the processor's and the thinker's input; the transformers engine answers as
the thinker does; and the states it hands on for a talker are those ``generate`` hands its talker,
zeros of the layer-0 input at the audio, so that a talker over them draws ``generate``'s codes.
Each check can fail: another clip moves the reply, and the states with the audio's embeddings left
in move the codes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor
from triton_omni.ar import ArLimits, ArRunner, ArRunnerConfig, GenerateRequest
from triton_omni.ar.audio_prompt import Qwen25Ears, ears_of
from triton_omni.audio import decode_audio
from triton_omni.demo_models import resolve_model
from triton_omni.errors import RequestValidationError
from triton_omni.speech.demos import CODEC_EOS, CODEC_PAD
from triton_omni.speech.qwen25_talker import Qwen25Talker

from tests.support.ar_runner import responses as run_to_end
from tests.support.heard import as_heard, tone, wav_bytes
from tests.support.qwen25 import generate_seen, greedy_codes, processor, user_turn

DEMO = "demo:tiny-qwen2.5-omni"
CLIPS = (tone(2.0, 440), tone(1.3, 220, seed=1))
REPLY_TOKENS, MAX_CODES = 6, 30


@pytest.fixture(scope="module")
def demo():
    folder = resolve_model(DEMO)
    return processor(folder), Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def runner():
    runner = ArRunner(ArRunnerConfig(model=DEMO, engine="transformers", max_model_len=1024))
    yield runner
    runner.close()


def test_the_prompt_is_the_processor_s_and_the_thinker_s_input(demo):
    """Two clips of different lengths: each marker widened to its clip's tokens, and the embeddings
    the thinker's own forward reads (its audio tower's in the markers' places)."""
    made, model = demo
    ears = ears_of(resolve_model(DEMO), torch.device("cpu"), torch.float32)
    assert isinstance(ears, Qwen25Ears) and ears.max_seconds == 300.0
    text = user_turn(made.tokenizer, "What is this?", 2)
    clips = [as_heard(clip) for clip in CLIPS]
    ids, embeds, _ = ears.prompt(made.tokenizer(text)["input_ids"], clips)
    inputs = made(text=text, audio=clips, return_tensors="pt")
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        read = model.thinker(**inputs, output_hidden_states=True).hidden_states[0][0]
    assert embeds.shape == read.shape and float((embeds - read).abs().max()) < 1e-6


def test_a_clip_longer_than_the_processor_hears_is_refused_by_name(runner):
    """The processor cuts a clip at its feature extractor's window (``n_samples``: 300 s in the model's);
    ``ar`` refuses it instead, naming the clip."""
    assert runner.audio_limits.max_seconds == runner.ears.max_seconds == 300.0
    with pytest.raises(RequestValidationError, match="longer than 300 s") as error:
        decode_audio([wav_bytes(tone(0.5, 440)), wav_bytes(tone(301.0, 440))], runner.audio_limits)
    assert error.value.parameter == "input_audio[1]"
    shorter = ears_of(resolve_model(DEMO), torch.device("cpu"), torch.float32)
    shorter.features = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, chunk_length=30)
    assert shorter.max_seconds == 30.0  # the window's, whatever the checkpoint's


def served(runner: ArRunner, text: str, clips, states: bool = False):
    """``ar``'s greedy reply to ``text`` with ``clips`` (WAV files): its ids, and with ``states`` the
    prompt as read and the thinker's states (the prompt's and every reply token's but the last)."""
    request = GenerateRequest.from_inputs(
        {"text_input": text, "input_audio": [wav_bytes(c) for c in clips], "max_tokens": REPLY_TOKENS,
         "temperature": 0.0, "return_token_ids": True, "return_thinker_states": states},
        ArLimits(), audio=runner.audio_limits)
    responses = run_to_end(runner, request)
    ids = [token for response in responses for token in response.token_ids[0]]
    if not states:
        return ids
    kept = [r.thinker_states for r in responses if r.thinker_states is not None]
    return ids, responses[0].heard[0], torch.cat(kept)


def test_the_transformers_engine_answers_audio_as_the_thinker_does_and_another_clip_moves_it(demo, runner):
    made, model = demo
    text = user_turn(made.tokenizer, "What is this?", 2)
    clips = [as_heard(clip) for clip in CLIPS]
    inputs = made(text=text, audio=clips, return_tensors="pt")
    with torch.no_grad():
        expected = model.thinker.generate(**inputs, max_new_tokens=REPLY_TOKENS, do_sample=False)
    reply = served(runner, text, CLIPS)
    assert reply == expected[0, inputs["input_ids"].shape[1]:].tolist()
    assert served(runner, text, [tone(2.0, 880, seed=2), CLIPS[1]]) != reply


def test_the_states_for_a_talker_are_generate_s_and_its_talker_draws_generate_s_codes(demo, runner):
    """The states ``ar`` hands on (``return_thinker_states``) for a prompt with audio: the reply is
    ``generate``'s, the talker's prompt over the states is the one ``generate`` handed its talker (the
    layer-0 input zero at the audio), and a greedy talker draws its codes. With the audio's embeddings
    left in the states, the talker draws other codes."""
    made, model = demo
    text = user_turn(made.tokenizer, "What is this?", 2)
    inputs = made(text=text, audio=[as_heard(clip) for clip in CLIPS], return_tensors="pt")
    reply, seen, _ = generate_seen(model, inputs, "Chelsie", thinker_do_sample=False,
                                   thinker_max_new_tokens=REPLY_TOKENS, talker_do_sample=False,
                                   talker_max_new_tokens=MAX_CODES, talker_eos_token_id=[CODEC_PAD, CODEC_EOS],
                                   token2wav_num_steps=2)
    ids, prompt_ids, states = served(runner, text, CLIPS, states=True)
    assert ids == reply and prompt_ids == inputs["input_ids"][0].tolist()
    assert states.shape == (len(prompt_ids) + len(reply) - 1, model.config.thinker_config.text_config.hidden_size)

    talker = Qwen25Talker(model.talker, model.thinker.get_input_embeddings(), model.speaker_map, model.config)
    prompt = talker.prompt(prompt_ids, reply, "chelsie", states=states)
    with torch.no_grad():
        expected = model.talker.thinker_to_talker_proj(seen["inputs_embeds"][0])
    assert prompt.embeds.shape == expected.shape and float((prompt.embeds - expected).abs().max()) < 1e-5
    codes = greedy_codes(talker, prompt, MAX_CODES)
    assert codes == seen["codes"] and len(codes) > 8

    ears = ears_of(resolve_model(DEMO), torch.device("cpu"), torch.float32)
    _, embeds, _ = ears.prompt(made.tokenizer(text)["input_ids"], [as_heard(clip) for clip in CLIPS])
    audio = np.array(prompt_ids) == ears.audio_token_id
    heard_in = states.clone()
    heard_in[: len(prompt_ids)][audio] += embeds[audio]  # the layer-0 input the LM read, not zeros
    assert greedy_codes(talker, talker.prompt(prompt_ids, reply, "chelsie", states=heard_in), MAX_CODES) != codes
