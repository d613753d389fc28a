"""Audio a thinker hears (``input_audio``): the files decoded as a transformers user loads them,
each refusal naming its clip, and the prompt the ``ar`` stage builds from them (its widened audio
markers and its embeddings) read by the thinker's LM as the whole model reads the processor's
features: the same greedy tokens, on the transformers engine (vLLM's: tests/integration/test_speech.py)."""

from __future__ import annotations

import io
import uuid

import av
import numpy as np
import pytest
import torch
from triton_omni.ar import ArLimits, ArRunner, ArRunnerConfig, GenerateRequest
from triton_omni.ar.audio_prompt import ThinkerEars, ears_of, output_lengths
from triton_omni.audio import AudioLimits, decode_audio
from triton_omni.demo_models import resolve_model
from triton_omni.errors import RequestValidationError

from tests.support.ar_runner import responses as run_to_end
from tests.support.ar_runner import spoken
from tests.support.heard import (
    DEMO,
    as_heard,
    model,
    prompt,
    reference,
    spoken_reference,
    thinker_states,
    tone,
    wav_bytes,
)

HEARS = AudioLimits(max_clips=2)


def refusal(files, limits=HEARS) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as error:
        decode_audio(files, limits)
    return error.value


def test_a_16khz_wav_decodes_to_its_samples_and_stereo_to_their_mean():
    clip = tone(0.5, 440)
    [heard] = decode_audio([wav_bytes(clip)], HEARS)
    assert heard.dtype == np.float32 and np.array_equal(heard, as_heard(clip))
    left, right = tone(0.5, 440), tone(0.5, 300, seed=1)
    [mixed] = decode_audio([wav_bytes(np.stack([left, right], axis=1).reshape(-1), channels=2)], HEARS)
    assert np.allclose(mixed, (as_heard(left) + as_heard(right)) / 2, atol=1e-7)


def test_another_rate_is_resampled_to_the_model_s():
    [heard] = decode_audio([wav_bytes(tone(1.0, 440, rate=44100), rate=44100)], HEARS)
    assert abs(heard.size - 16000) <= 32
    spectrum = np.abs(np.fft.rfft(heard[:16000]))
    assert abs(int(np.argmax(spectrum)) - 440) <= 2  # the tone is where it was (1 Hz a bin)


def test_an_mp3_decodes_too():
    out = io.BytesIO()
    with av.open(out, "w", format="mp3") as container:
        stream = container.add_stream("libmp3lame", rate=16000, layout="mono")
        frame = av.AudioFrame.from_ndarray(tone(1.0, 440)[None], format="flt", layout="mono")
        frame.rate = 16000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    [heard] = decode_audio([out.getvalue()], HEARS)
    assert 15000 < heard.size < 18000 and np.abs(heard).max() > 0.2


@pytest.mark.parametrize(("files", "limits", "field", "says"), [
    ([b"not audio at all"], HEARS, "input_audio[0]", "is not an audio file"),
    ([b""], HEARS, "input_audio[0]", "is empty"),
    ([wav_bytes(tone(0.1, 440)), b"RIFF"], HEARS, "input_audio[1]", "is not an audio file"),
    ([wav_bytes(tone(0.1, 440))] * 3, HEARS, "input_audio", "at most 2 clips"),
    ([], HEARS, "input_audio", "holds no audio clip"),
    ([wav_bytes(tone(2.0, 440))], AudioLimits(max_clips=1, max_seconds=1.0), "input_audio[0]", "longer than 1 s"),
    ([wav_bytes(tone(0.1, 440))], AudioLimits(), "input_audio", "hears no audio"),
])
def test_bad_audio_is_refused_naming_the_clip(files, limits, field, says):
    error = refusal(files, limits)
    assert error.parameter == field and says in str(error)


def test_the_token_count_of_a_clip_is_the_model_s():
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    frames = torch.arange(1, 3001)
    assert torch.equal(output_lengths(frames, 50), _get_feat_extract_output_lengths(frames, 50))


@pytest.fixture(scope="module")
def ears() -> ThinkerEars:
    return ears_of(resolve_model(DEMO), torch.device("cpu"), torch.float32)


def test_the_prompt_widens_each_marker_as_the_processor_does(ears):
    """Two clips of different lengths in one prompt: each marker widened to its clip's tokens (the
    shorter clip's count depends on the longer one beside it, as the processor pads them together)."""
    tokenizer, processor, _ = model()
    text = prompt("What is this?", 2)
    clips = [tone(2.0, 440), tone(1.3, 220, seed=1)]
    ids, embeds, _ = ears.prompt(tokenizer(text)["input_ids"], clips)
    assert ids == processor(text=text, audio=clips, return_tensors="pt")["input_ids"][0].tolist()
    assert embeds.shape == (len(ids), ears.embed_tokens.shape[1])
    with pytest.raises(RequestValidationError, match=r"2 audio markers .* for 1 clips") as error:
        ears.prompt(tokenizer(text)["input_ids"], clips[:1])
    assert error.value.parameter == "input_audio"


@pytest.fixture(scope="module")
def runner():
    runner = ArRunner(ArRunnerConfig(model=DEMO, engine="transformers", max_model_len=8192))
    yield runner
    runner.close()


def reply(runner: ArRunner, text: str, clips: list[bytes], max_tokens: int = 6) -> list[int]:
    request = GenerateRequest.from_inputs({"text_input": text, "input_audio": clips, "max_tokens": max_tokens,
                                           "temperature": 0.0, "return_token_ids": True}, ArLimits(),
                                          audio=runner.audio_limits)
    ids: list[int] = []

    async def run():
        async for response in runner.generate(request, uuid.uuid4().hex):
            ids.extend(response.token_ids[0])

    runner.loop.run(run(), timeout=120)
    return ids


def test_the_transformers_engine_answers_audio_as_the_model_does_and_another_clip_moves_it(runner):
    text = prompt("What is this?", 2)
    first, second = tone(2.0, 440), tone(1.3, 220, seed=1)
    files = [wav_bytes(first), wav_bytes(second)]
    served = reply(runner, text, files)
    assert served == reference(text, [as_heard(first), as_heard(second)], 6)
    # the check can fail: the clips are heard, each of them (other tones of the same lengths: other replies)
    for others in ([tone(2.0, 220, seed=2), second], [first, tone(1.3, 880, seed=3)]):
        assert reply(runner, text, [wav_bytes(clip) for clip in others]) != served


def test_a_prompt_whose_audio_overflows_the_context_is_refused_by_name():
    runner = ArRunner(ArRunnerConfig(model=DEMO, engine="transformers", max_model_len=64))
    try:
        with pytest.raises(RequestValidationError, match="with its audio has") as error:
            reply(runner, prompt("hi", 1), [wav_bytes(tone(5.0, 440))])
        assert error.value.parameter == "input_audio"
    finally:
        runner.close()


def test_a_model_that_hears_nothing_refuses_input_audio_by_name():
    with pytest.raises(RequestValidationError, match="hears no audio") as error:
        GenerateRequest.from_inputs({"text_input": "hi", "input_audio": [wav_bytes(tone(0.1, 440))]}, ArLimits())
    assert error.value.parameter == "input_audio"


def test_a_spoken_reply_to_audio_is_the_model_s(runner):
    """The transformers engine hands on the prompt as read and its states at the audio (the talker's
    layer), equal to the whole model's thinker's; the speech stage given them speaks generate's
    codes. Without the states (the audio tokens' embeddings read as text) the codes differ: the
    check can fail."""
    from triton_omni.speech.runner import SpeechConfig, SpeechRunner

    text, clips = prompt("What is this?", 2), [tone(2.0, 440), tone(1.3, 220, seed=1)]
    heard = [as_heard(clip) for clip in clips]
    request = GenerateRequest.from_inputs({"text_input": text, "input_audio": [wav_bytes(c) for c in clips],
                                           "max_tokens": 4, "temperature": 0.0, "return_token_ids": True,
                                           "return_heard_states": True}, ArLimits(), audio=runner.audio_limits)
    responses = run_to_end(runner, request)
    prompt_ids, states, positions = responses[0].heard
    assert positions is None  # (a prompt with images has them)
    reply_ids = [token for response in responses for token in response.token_ids[0]]
    layer = runner.ears.talker_layer
    assert torch.allclose(states, thinker_states(text, heard, layer), atol=1e-5)
    expected_reply, expected_codes, expected_wav = spoken_reference(text, heard, 4, 10)
    assert reply_ids == expected_reply

    speech = SpeechRunner(SpeechConfig(model=DEMO))
    try:
        def said(states) -> tuple[np.ndarray, np.ndarray]:
            return spoken(speech, {"text_input": text, "reply_ids": reply_ids, "prompt_ids": prompt_ids,
                                   "heard_states": states, "temperature": 0.0, "max_tokens": 10, "min_tokens": 10})

        wav, codes = said(states)
        assert np.array_equal(codes, expected_codes) and np.abs(wav - expected_wav).max() < 1e-4
        with pytest.raises(RequestValidationError, match="holds 0 states") as error:
            said(None)
        assert error.value.parameter == "heard_states"
        wrong, _ = said(torch.zeros_like(states))
        assert np.abs(wrong - expected_wav).max() > 100 * 1e-4
    finally:
        speech.close()
