"""Speech out through Triton (``serve --demo qwen3-omni``): ``ar`` serves the tiny Qwen3-Omni's
thinker, ``speech`` its talker and ``code2wav``, ``omni`` chains them.

Every route is held to the model's own ``generate(..., return_audio=True)`` with greedy decoding in
the thinker and the talker: the same text, the same codec frames, and the waveform within
``TOLERANCE``; another voice moves that waveform more than a hundred times as far (checked here, so
the tolerance can fail)."""

from __future__ import annotations

import base64
import functools
import io
import json
import queue
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import av
import numpy as np
import openai
import pytest
import torch
import tritonclient.grpc as grpcclient
from triton_omni.speech.demos import THINKER_CONTEXT
from triton_omni_client import OmniClient, OmniError
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, free_port
from triton_omni_tools.repository import copy_model

from tests.support import heard
from tests.support.server import documented_metrics, metric_value, serving_openai

PROMPT = "a red fox"
THINKER = {"max_tokens": 8, "temperature": 0.0}
# the end of speech held off to max_tokens: a fixed length, so that two voices' waveforms compare
TALKER = {"talker_temperature": 0.0, "talker_max_tokens": 12, "talker_min_tokens": 12}
TOLERANCE = 1e-4  # of full scale; the streamed decode's float32 rounding is about 5e-7
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def speech_server(tmp_path_factory):
    """The server, and the OpenAI gateway in front of it as `serve` starts it (``server.openai``).
    Beside the demo's models, the same thinker on the transformers engine (``ar_heard``), which
    hands on its states at a prompt's audio, and an ``omni_heard`` whose thinker it is."""
    heard_models = tmp_path_factory.mktemp("heard")
    thinker = {"model": "demo:tiny-qwen3-omni", "engine": "transformers", "max_model_len": str(THINKER_CONTEXT),
               "max_tokens_limit": str(THINKER_CONTEXT)}
    copy_model(ROOT / "model_repository", "ar", heard_models, name="ar_heard", parameters=thinker)
    copy_model(ROOT / "model_repository", "omni", heard_models, name="omni_heard",
               parameters={"ar_model": "ar_heard", "speech_checkpoint": "demo:tiny-qwen3-omni"})
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            model_repositories=[*DEFAULT_REPOSITORIES, heard_models],
                            model_control_mode="explicit", demo="qwen3-omni",
                            load_models=["ar", "speech", "omni", "ar_heard", "omni_heard"],
                            log_file=Path(tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    with serving_openai(options, chat=True) as server:
        yield server


@functools.cache
def reference(prompt: str = PROMPT, voice: str = "ethan") -> tuple[str, str, np.ndarray, np.ndarray]:
    """The model's own generate, greedy: (the templated prompt, the reply's text, codes, waveform)."""
    tokenizer, _, _ = heard.model()
    templated = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=False)
    assert TALKER["talker_max_tokens"] == TALKER["talker_min_tokens"]  # one length: generate_spoken's
    ids, codes, wav = heard.generate_spoken(tokenizer(templated, return_tensors="pt"), THINKER["max_tokens"],
                                            TALKER["talker_max_tokens"], voice)
    return templated, tokenizer.decode(ids, skip_special_tokens=True), codes, wav


def spoken(events) -> tuple[str, np.ndarray, np.ndarray]:
    events = list(events)
    text = "".join(e.text for e in events if e.text)
    audio = np.concatenate([e.audio for e in events if e.audio is not None])
    codes = np.concatenate([e.audio_codes for e in events if e.audio_codes is not None], axis=1)
    return text, audio, codes


def test_omni_speaks_as_the_models_generate(speech_server):
    _, reply, codes, wav = reference()
    other_voice = reference(voice="chelsie")[3]
    assert np.abs(other_voice - wav).max() > 100 * TOLERANCE  # a wrong talker input moves it far past
    client = OmniClient(speech_server.grpc_url)
    for stream in (True, False):
        text, audio, served_codes = spoken(client.generate(PROMPT, modalities=["text", "audio"], stream=stream,
                                                           chunk_frames=2, **THINKER, **TALKER))
        assert text == reply
        np.testing.assert_array_equal(served_codes, codes)
        assert audio.shape == wav.shape and np.abs(audio - wav).max() <= TOLERANCE
    # audio alone: the same speech, no text events; another voice speaks as generate's other voice
    text, audio, _ = spoken(client.generate(PROMPT, modalities=["audio"], voice="chelsie", **THINKER, **TALKER))
    assert text == "" and np.abs(audio - other_voice).max() <= TOLERANCE
    for name, kind in documented_metrics().items():  # the speech stage's metrics, served with counts
        if name.startswith("omni_speech_") and kind != "gauge":
            assert metric_value(speech_server, name + ("_count" if kind == "histogram" else ""),
                                model="speech") > 0, name


def test_the_speech_stage_streams_chunks_that_join_into_the_whole_decode(speech_server):
    """Called directly, as a client of the stage: small chunks, their samples one after another
    equal the whole utterance's decode (and generate's waveform); a chunk boundary decoded as its
    own utterance (code2wav's chunked_decode) would not."""
    templated, _, codes, wav = reference()
    omni = heard.model()[2]
    chunks = speak_directly(speech_server.grpc_url, templated, _ar_reply_ids(speech_server.grpc_url, templated),
                            chunk_frames=3)
    audio = np.concatenate([c["audio"] for c in chunks])
    # the model's first chunk is 1 frame (first_chunk_frames), the next twice that, then 3 at a time
    # (chunk_frames); the end of speech comes with the frames left, or alone (no frames) when the
    # last chunk was full
    left = codes.shape[1] - 3
    sizes = [1, 2, *[3] * (left // 3), left % 3]
    assert [c["codes"].shape[1] for c in chunks] == sizes and chunks[-1]["finish_reason"] == "length"
    np.testing.assert_array_equal(np.concatenate([c["codes"] for c in chunks], axis=1), codes)
    assert np.abs(audio - wav).max() <= TOLERANCE
    # a chunk size the frames fill exactly: the last response holds no samples, only the finish reason
    exact = speak_directly(speech_server.grpc_url, templated, _ar_reply_ids(speech_server.grpc_url, templated),
                           chunk_frames=codes.shape[1], first_chunk_frames=codes.shape[1])
    assert [len(c["audio"]) for c in exact] == [len(wav), 0] and exact[-1]["finish_reason"] == "length"
    with torch.no_grad():
        whole_chunks = omni.code2wav.chunked_decode(torch.from_numpy(codes)[None], chunk_size=3).flatten().numpy()
    assert len(whole_chunks) != len(wav)  # the model's own chunking cuts samples at each boundary


def _ar_reply_ids(url: str, templated: str) -> np.ndarray:
    """The thinker's reply as ``ar`` serves it: its token ids (``return_token_ids``)."""
    [result] = _stream(url, "ar", text_input=np.array([templated.encode()], dtype=object),
                       stream=np.array([False]), return_token_ids=np.array([True]),
                       temperature=np.array([0.0], np.float32), max_tokens=np.array([8], np.int32))
    return result.as_numpy("token_ids")


def speak_directly(url: str, templated: str, reply_ids: np.ndarray, **options) -> list[dict]:
    values = {"text_input": np.array([templated.encode()], dtype=object), "reply_ids": reply_ids.astype(np.int64),
              "temperature": np.array([0.0], np.float32),
              "max_tokens": np.array([TALKER["talker_max_tokens"]], np.int32),
              "min_tokens": np.array([TALKER["talker_min_tokens"]], np.int32)}
    values |= {name: np.array([value], np.int32) for name, value in options.items()}
    return [{"audio": r.as_numpy("audio"), "codes": r.as_numpy("codes"),
             "finish_reason": None if r.as_numpy("finish_reason") is None else r.as_numpy("finish_reason")[0].decode()}
            for r in _stream(url, "speech", **values)]


def _stream(url: str, model: str, **values: np.ndarray) -> list:
    """One request on a gRPC stream; its responses, an error raised as the client reads it."""
    types = {np.dtype(object): "BYTES", np.dtype(bool): "BOOL", np.dtype(np.float32): "FP32",
             np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}
    inputs = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), types[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                client.stop_stream()
                raise RuntimeError(str(error))
            if result.get_response().parameters["triton_final_response"].bool_param:
                if result.as_numpy("audio") is not None or result.as_numpy("text_output") is not None:
                    responses.append(result)
                client.stop_stream()
                return responses
            responses.append(result)


CLIPS = (heard.tone(2.0, 440), heard.tone(1.3, 220, seed=1))


def _heard_reply(url: str, text: str, files: list[bytes], max_tokens: int = 6) -> list[int]:
    """``ar``'s greedy reply to a prompt with ``input_audio`` (one file per audio marker): its token ids."""
    [result] = _stream(url, "ar", text_input=np.array([text.encode()], dtype=object),
                       input_audio=np.array(files, dtype=object), stream=np.array([False]),
                       return_token_ids=np.array([True]), temperature=np.array([0.0], np.float32),
                       max_tokens=np.array([max_tokens], np.int32))
    return result.as_numpy("token_ids").tolist()


def test_the_thinker_hears_input_audio_as_the_model_does(speech_server):
    """vLLM's thinker handed the prompt as embeddings (the audio tower's in the markers' places) gives
    the whole model's greedy reply to the processor's features; other clips give other replies."""
    text = heard.prompt(PROMPT, 2)
    served = _heard_reply(speech_server.grpc_url, text, [heard.wav_bytes(clip) for clip in CLIPS])
    assert served == heard.reference(text, [heard.as_heard(clip) for clip in CLIPS], 6)
    other = [heard.wav_bytes(heard.tone(2.0, 220, seed=2)), heard.wav_bytes(CLIPS[1])]
    assert _heard_reply(speech_server.grpc_url, text, other) != served


def test_images_to_a_thinker_on_vllm_are_refused_by_name_and_the_next_request_is_served(speech_server):
    """vLLM is handed the thinker's language model alone, which knows no image positions: ``images``
    on ``ar`` there is a typed error naming it (the transformers engine reads them:
    tests/unit/test_image_input.py), and the model serves on."""
    from tests.support.qwen25 import noise, png

    text = heard.prompt(PROMPT, 0).replace(PROMPT, "<|vision_start|><|image_pad|><|vision_end|>" + PROMPT)
    with pytest.raises(RuntimeError, match="`images`") as error:
        _stream(speech_server.grpc_url, "ar", text_input=np.array([text.encode()], dtype=object),
                images=np.array([png(noise(64, 64, 0))], dtype=object), max_tokens=np.array([4], np.int32))
    assert "engine: transformers" in str(error.value)
    assert _heard_reply(speech_server.grpc_url, heard.prompt(PROMPT, 1), [heard.wav_bytes(CLIPS[0])])


def test_the_gateway_reads_input_audio_parts(speech_server):
    """``input_audio`` content parts through the ``openai`` SDK: the reply is the model's to the same
    clips, its prompt tokens the processor's; a spoken reply to audio from a thinker on vLLM (which
    hands on no hidden states) is refused naming the part."""
    tokenizer, processor, _ = heard.model()
    parts = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(heard.wav_bytes(clip)).decode(),
                                                     "format": "wav"}} for clip in CLIPS]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]
    answer = speech_server.openai.chat.completions.create(model="ar", messages=messages, max_tokens=6,
                                                         temperature=0.0)
    text, clips = heard.prompt(PROMPT, 2), [heard.as_heard(clip) for clip in CLIPS]
    expected = tokenizer.decode(heard.reference(text, clips, 6), skip_special_tokens=True)
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens == processor(text=text, audio=clips, return_tensors="pt")["input_ids"].shape[1]
    with pytest.raises(openai.BadRequestError) as refused:
        speech_server.openai.chat.completions.create(model="ar", messages=messages, modalities=["text", "audio"],
                                                     audio={"voice": "ethan", "format": "wav"})
    assert refused.value.body["param"] == "messages.0.content.0"
    junk = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"not audio").decode(), "format": "wav"}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            speech_server.openai.chat.completions.create(
                model="ar", messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}, junk]}],
                stream=stream)
        assert refused.value.body["param"] == "messages.0.content.1"


HEARD_TALKER = {"temperature": 0.0, "max_tokens": 10, "min_tokens": 10}


def test_a_spoken_reply_to_audio_is_the_model_s_through_omni_and_the_gateway(speech_server):
    """Speech in, speech out, on the thinker served by the transformers engine: ``omni`` (gRPC) and
    the gateway (the ``openai`` SDK, ``input_audio`` parts and ``modalities: ["text", "audio"]``)
    give the whole model's ``generate(..., return_audio=True)`` for the same clips: its text, its
    codec frames, its waveform (to 16-bit PCM's step through the gateway). The talker reads the
    thinker's states at the audio: given the clips' embeddings as text instead, its frames differ
    (tests/unit/test_audio_input.py), so these checks can fail."""
    text, clips = heard.prompt(PROMPT, 2), [heard.as_heard(clip) for clip in CLIPS]
    reply_ids, codes, wav = heard.spoken_reference(text, clips, 4, HEARD_TALKER["max_tokens"])
    tokenizer, _, _ = heard.model()
    reply = tokenizer.decode(reply_ids, skip_special_tokens=True)
    files = [heard.wav_bytes(clip) for clip in CLIPS]
    options = {"max_tokens": 4, "temperature": 0.0, **{f"talker_{k}": v for k, v in HEARD_TALKER.items()}}
    said, audio, frames = spoken(OmniClient(speech_server.grpc_url).generate(
        PROMPT, modalities=["text", "audio"], input_audio=files, model="omni_heard", **options))
    assert said == reply and np.array_equal(frames, codes) and np.abs(audio - wav).max() <= TOLERANCE

    parts = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(f).decode(), "format": "wav"}}
             for f in files]
    answer = speech_server.openai.chat.completions.create(
        model="ar_heard", messages=[{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}],
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}, max_tokens=4, temperature=0.0,
        extra_body={"talker": HEARD_TALKER})
    with av.open(io.BytesIO(base64.b64decode(answer.choices[0].message.audio.data))) as container:
        samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)])
    samples = samples.astype(np.float32) / 32768 if samples.dtype == np.int16 else samples
    assert answer.choices[0].message.audio.transcript == reply
    assert samples.shape == wav.shape and np.abs(samples - wav).max() <= TOLERANCE + PCM16


def test_omni_on_a_vllm_thinker_hears_audio_and_refuses_to_speak_to_it_by_name(speech_server):
    """``omni``'s text route with ``input_audio`` (the prompt its model's template, the clips' parts
    before the text) gives the model's reply; its audio route on a thinker served by vLLM is refused
    naming what that engine cannot hand on, and the next request is served."""
    tokenizer, _, _ = heard.model()
    files = [heard.wav_bytes(clip) for clip in CLIPS]
    expected = heard.reference(heard.prompt(PROMPT, 2), [heard.as_heard(clip) for clip in CLIPS], 6)
    client = OmniClient(speech_server.grpc_url)
    said = "".join(e.text for e in client.generate(PROMPT, input_audio=files, max_tokens=6, temperature=0.0) if e.text)
    assert said == tokenizer.decode(expected, skip_special_tokens=True)
    with pytest.raises(OmniError, match="return_heard_states"):
        list(client.generate(PROMPT, modalities=["text", "audio"], input_audio=files, max_tokens=2))
    from tests.support.qwen25 import noise, png

    with pytest.raises(OmniError, match=r"`images`.*engine: transformers"):  # what a spoken reply to images needs
        list(client.generate(PROMPT, modalities=["text", "audio"], images=[png(noise(64, 64, 0))], max_tokens=2))
    assert list(client.generate(PROMPT, max_tokens=2, temperature=0.0))


@pytest.mark.parametrize(("files", "clips", "field"), [
    ([b"not audio"], 1, "input_audio[0]"),
    ([heard.wav_bytes(CLIPS[0])], 2, "input_audio"),  # two markers in the prompt, one clip
    ([heard.wav_bytes(heard.tone(301.0, 440))], 1, "input_audio[0]"),  # past 300 s
])
def test_bad_input_audio_is_refused_by_name_and_the_next_request_is_served(speech_server, files, clips, field):
    with pytest.raises(RuntimeError, match=f"invalid `{re.escape(field)}`"):
        _heard_reply(speech_server.grpc_url, heard.prompt(PROMPT, clips), files)
    assert _heard_reply(speech_server.grpc_url, heard.prompt(PROMPT, 1), [heard.wav_bytes(CLIPS[1])])


@pytest.mark.parametrize(("options", "field"), [
    ({"voice": "nobody"}, "voice"),
    ({"talker_temperature": -1.0}, "temperature"),
    ({"talker_max_tokens": 0}, "max_tokens"),
    ({"chunk_frames": 0}, "chunk_frames"),
    ({"first_chunk_frames": 0}, "first_chunk_frames"),
])
def test_bad_speech_options_are_refused_by_name_and_the_next_request_is_served(speech_server, options, field):
    client = OmniClient(speech_server.grpc_url)
    with pytest.raises(OmniError) as error:
        list(client.generate(PROMPT, modalities=["audio"], **THINKER, **(TALKER | options)))
    assert error.value.status == "INVALID_ARG" and f"`{field}`" in str(error.value)
    _, audio, _ = spoken(client.generate(PROMPT, modalities=["audio"], **THINKER, **TALKER))
    assert np.abs(audio - reference()[3]).max() <= TOLERANCE


def test_the_speech_stage_refuses_an_empty_reply_and_prompt(speech_server):
    templated = reference()[0]
    for values, field in (({"reply_ids": np.zeros(0, np.int64)}, "reply_ids"),
                          ({"text_input": np.array([b" "], dtype=object)}, "text_input")):
        base = {"text_input": np.array([templated.encode()], dtype=object), "reply_ids": np.array([5], np.int64)}
        with pytest.raises(RuntimeError, match=f"`{field}`"):
            _stream(speech_server.grpc_url, "speech", **(base | values))


def test_a_client_that_leaves_while_the_thinker_writes_stops_the_thinker_and_the_talker(speech_server):
    """The talker starts at the reply's first token: a client that leaves then stops both (each
    counts the request cancelled, neither finishes it), or the talker before it was asked. The
    reply asked for is the demo thinker's whole context: on starved cores its first thousand
    tokens were written before the client read the first one (seen in CI, when the reply asked
    for was 800 tokens)."""
    client = OmniClient(speech_server.grpc_url)
    ar = functools.partial(metric_value, speech_server, "omni_ar_requests_total", model="ar")
    speech = functools.partial(metric_value, speech_server, "omni_speech_requests_total", model="speech")
    _settle(speech_server)  # an earlier test's requests ended and counted
    cancelled, finished = ar(outcome="cancelled"), ar(outcome="success")
    spoken, spoken_whole, spoken_cancelled = speech(), speech(outcome="success"), speech(outcome="cancelled")
    reply = THINKER_CONTEXT - 64  # the templated prompt fits in the rest
    talker = TALKER | {"talker_max_tokens": 2000, "talker_min_tokens": 2000}  # speaking until the reply ends
    events = client.generate(PROMPT, modalities=["text", "audio"], max_tokens=reply, temperature=0.0,
                             parameters={"min_tokens": reply, "ignore_eos": True}, **talker)
    next(e for e in events if e.text)
    events.close()
    deadline = time.monotonic() + 30
    while ar(outcome="cancelled") == cancelled:
        assert ar(outcome="success") == finished, "the thinker wrote its whole reply: the cancellation was lost"
        assert time.monotonic() < deadline, "the thinker never saw the cancellation"
        time.sleep(0.2)
    _settle(speech_server)
    assert speech(outcome="success") == spoken_whole  # the talker did not speak on
    assert speech() - spoken == speech(outcome="cancelled") - spoken_cancelled <= 1
    _ends_reach_omni(speech_server)


def _ends_reach_omni(server, timeout_s: float = 10) -> None:
    """Every cancelled stage stream ended in omni: its cancel flag and its recorded error are gone
    from the run directory. Triton 2.51's BLS lost each stage's CANCELLED (an error response after
    the stream's first), so omni's drain waited until its 30 s bound removed the flag."""
    deadline = time.monotonic() + timeout_s
    while left := sorted(p.name for p in server.run_dir.glob("*") if p.suffix in (".cancel", ".error")):
        assert time.monotonic() < deadline, f"stage streams whose end never reached omni: {left}"
        time.sleep(0.2)


def _settle(server, timeout_s: float = 30) -> None:
    """Until no stage holds a request, twice in a row half a second apart (a sub-request on its way
    to a stage is in no gauge yet)."""
    gauges = [("omni_scheduler_requests_in_flight", "omni"), ("omni_ar_requests_in_flight", "ar"),
              ("omni_speech_requests_in_flight", "speech")]
    idle = lambda: all(metric_value(server, name, model=model) == 0 for name, model in gauges)  # noqa: E731
    deadline = time.monotonic() + timeout_s
    while not (idle() and (time.sleep(0.5) or idle())):
        assert time.monotonic() < deadline, "the stages still hold requests"
        time.sleep(0.2)


def test_a_client_that_leaves_mid_speech_stops_the_talker(speech_server):
    """A long utterance (the end of speech held off), left after its first audio: the speech stage
    counts the request cancelled, and its audio stops growing (the talker dropped it)."""
    client = OmniClient(speech_server.grpc_url)
    before = metric_value(speech_server, "omni_speech_requests_total", model="speech", outcome="cancelled")
    events = client.generate(PROMPT, modalities=["audio"], **THINKER, talker_temperature=0.0,
                             talker_max_tokens=4000, talker_min_tokens=4000, chunk_frames=2)
    next(e for e in events if e.audio is not None)
    events.close()
    deadline = time.monotonic() + 30
    while metric_value(speech_server, "omni_speech_requests_total", model="speech", outcome="cancelled") == before:
        assert time.monotonic() < deadline, "the speech stage never saw the cancellation"
        time.sleep(0.2)
    spoken_seconds = metric_value(speech_server, "omni_speech_audio_seconds_total", model="speech")
    time.sleep(1.0)
    assert metric_value(speech_server, "omni_speech_audio_seconds_total", model="speech") == spoken_seconds
    assert spoken_seconds < 4000 / 12.5  # far from the whole utterance
    _ends_reach_omni(speech_server)


def test_audio_from_a_server_that_cannot_speak_is_refused_by_name(server):
    """The shared server's omni has no speech stage."""
    with pytest.raises(OmniError) as error:
        list(OmniClient(server.grpc_url).generate(PROMPT, modalities=["text", "audio"], max_tokens=4))
    assert error.value.status == "INVALID_ARG" and "`modalities`" in str(error.value)


# the talker's options through the gateway (its extension), greedy as the reference
GATEWAY_TALKER = {"temperature": 0.0, "max_tokens": TALKER["talker_max_tokens"],
                  "min_tokens": TALKER["talker_min_tokens"]}
PCM16 = 1 / 32767  # a sample's step in 16-bit PCM


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767


def test_the_gateway_speaks_a_chat_as_the_models_generate(speech_server):
    """``/v1/chat/completions`` with ``modalities: ["text", "audio"]`` through the ``openai`` SDK:
    the transcript is generate's text and the audio its waveform (to 16-bit PCM's step), whole (a WAV
    in ``message.audio``) and streamed (``delta.audio``: the transcript, then pcm16 data)."""
    _, reply, _, wav = reference()
    chat = {"model": "ar", "messages": [{"role": "user", "content": PROMPT}], "modalities": ["text", "audio"],
            "max_tokens": THINKER["max_tokens"], "temperature": 0.0, "extra_body": {"talker": GATEWAY_TALKER}}
    answer = speech_server.openai.chat.completions.create(audio={"voice": "ethan", "format": "wav"}, **chat)
    audio = answer.choices[0].message.audio
    assert audio.transcript == reply and audio.id and audio.expires_at > time.time()
    with av.open(io.BytesIO(base64.b64decode(audio.data))) as container:
        samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)])
        assert container.streams.audio[0].rate == 24000
    samples = samples.astype(np.float32) / 32768 if samples.dtype == np.int16 else samples
    assert samples.shape == wav.shape and np.abs(samples - wav).max() <= TOLERANCE + PCM16

    transcript, data = "", b""
    for chunk in speech_server.openai.chat.completions.create(audio={"voice": "ethan", "format": "pcm16"},
                                                             stream=True, **chat):
        if chunk.choices and chunk.choices[0].delta.audio is not None:
            transcript += chunk.choices[0].delta.audio.transcript or ""
            data += base64.b64decode(chunk.choices[0].delta.audio.data or "")
    assert transcript == reply and np.abs(pcm16(data) - wav).max() <= TOLERANCE + PCM16


def test_the_speech_endpoint_speaks_its_input_in_every_format(speech_server):
    """``/v1/audio/speech``: the WAV whole, its samples streamed as raw PCM and as server-sent events
    (the same bytes), and the encoded formats PyAV decodes to the same length of audio."""
    client = speech_server.openai
    speech = {"model": "speech", "input": "a red fox", "voice": "chelsie", "extra_body": {"talker": GATEWAY_TALKER}}
    wav = client.audio.speech.create(response_format="wav", **speech).content
    assert wav[:4] == b"RIFF" and len(wav) > 44
    samples = pcm16(wav[44:])
    with client.audio.speech.with_streaming_response.create(
            response_format="pcm", **(speech | {"extra_body": {"talker": GATEWAY_TALKER, "stream_format": "audio"}})
    ) as streamed:
        assert streamed.headers["content-type"] == "audio/pcm"
        assert b"".join(streamed.iter_bytes()) == wav[44:]
    with client.audio.speech.with_streaming_response.create(
            response_format="pcm", **(speech | {"extra_body": {"talker": GATEWAY_TALKER, "stream_format": "sse"}})
    ) as events:
        pieces = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: ")]
    assert pieces[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(p["audio"]) for p in pieces[:-1]) == wav[44:]
    for format in ("mp3", "flac", "opus", "aac"):
        encoded = client.audio.speech.create(response_format=format, **speech).content
        with av.open(io.BytesIO(encoded)) as container:
            frames = [frame for frame in container.decode(audio=0)]
        seconds = sum(frame.samples for frame in frames) / frames[0].sample_rate
        assert abs(seconds - len(samples) / 24000) < 0.1, format
    voices = json.loads(urllib.request.urlopen(f"{speech_server.gateway_url}/v1/audio/voices").read())
    assert voices == {"voices": ["chelsie", "ethan"]}


@pytest.mark.parametrize(("body", "param"), [
    ({"voice": "nobody"}, "voice"),
    ({"speed": 1.5}, "speed"),
    ({"input": " "}, "input"),
    ({"response_format": "ogg"}, "response_format"),
    ({"model": "ar_encoder"}, "model"),
    ({"model": "tts-1"}, "model"),  # OpenAI's name, not served here
])
def test_the_speech_endpoint_names_what_it_refuses(speech_server, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        speech_server.openai.audio.speech.create(**({"model": "speech", "input": "hi", "voice": "ethan"} | body))
    assert error.value.body["param"] == param
    if param == "model":  # a model that does not speak: the ones that do are named
        assert "does not speak: the speech model here: 'speech'" in error.value.message
    assert speech_server.openai.audio.speech.create(model="speech", input="hi", voice="ethan",
                                                    response_format="wav").content[:4] == b"RIFF"


def test_the_cli_writes_the_spoken_reply(speech_server, tmp_path):
    """`omni-triton generate --modalities text,audio --out reply.wav`: the reply's text on stdout, its
    waveform in the WAV (generate's, to 16-bit PCM's step); with `--audio FILE` (twice), the reply to
    the clips is the model's."""
    import subprocess
    import sys
    import wave

    _, reply, _, expected = reference()
    talker = [f"--param={key}={value}" for key, value in TALKER.items()]
    done = subprocess.run([str(Path(sys.executable).parent / "omni-triton"), "generate", PROMPT, "--url",
                           speech_server.grpc_url, "--modalities", "text,audio", "--out", str(tmp_path / "reply.wav"),
                           "--max-tokens", str(THINKER["max_tokens"]), "--param=temperature=0", *talker],
                          check=True, capture_output=True, text=True)
    assert done.stdout.startswith(reply) and "wrote" in done.stdout
    with wave.open(str(tmp_path / "reply.wav")) as file:
        assert file.getframerate() == 24000
        samples = pcm16(file.readframes(file.getnframes()))
    assert samples.shape == expected.shape and np.abs(samples - expected).max() <= TOLERANCE + PCM16

    clips = []
    for index, clip in enumerate(CLIPS):
        clips += ["--audio", str(tmp_path / f"clip{index}.wav")]
        (tmp_path / f"clip{index}.wav").write_bytes(heard.wav_bytes(clip))
    heard_reply = heard.reference(heard.prompt(PROMPT, 2), [heard.as_heard(clip) for clip in CLIPS], 6)
    done = subprocess.run([str(Path(sys.executable).parent / "omni-triton"), "generate", PROMPT, "--url",
                           speech_server.grpc_url, *clips, "--max-tokens", "6", "--param=temperature=0"],
                          check=True, capture_output=True, text=True)
    assert done.stdout.strip() == heard.model()[0].decode(heard_reply, skip_special_tokens=True).strip()


def test_the_speech_bench_measures_this_server(speech_server, tmp_path):
    """``benchmarks/speech.py --url`` against this server and the tiny demo's own generate: each
    figure is printed at each concurrency (first audio, first text, RTF, stalls, requests/s, and
    the stages' own first token and first audio from the server's metrics), never checked
    (docs/benchmarks.md quotes a GPU's)."""
    out = tmp_path / "speech.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speech.py"), "--url", speech_server.grpc_url,
                             "--metrics-url", speech_server.metrics_url, "--concurrency", "1,2", "--requests", "2",
                             "--direct-requests", "1", "--prompt-tokens", "20", "--text-tokens", "6",
                             "--audio-seconds", "0.5", "--with-text", "--json", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    for level in ("1", "2"):
        found = report["triton"][level]
        assert found["requests"] == 2 and found["audio_s"] > 0 and found["requests_per_s"] > 0
        assert min(found["ttfa_ms"], found["ttft_ms"], found["rtf"]) > 0
        assert found["stall_ms_max"] >= found["stall_ms"] >= 0
        phases = {f"speech_{phase}_ms" for phase in ("prompt", "join", "first_frame", "frames", "decode")}
        assert set(found["stages"]) == {"ar_ttft_ms", "ar_tpot_ms", "speech_ttfa_ms"} | phases
        assert min(found["stages"][name]
                   for name in ("ar_ttft_ms", "ar_tpot_ms", "speech_ttfa_ms", "speech_decode_ms")) > 0
    assert report["direct"]["audio_s"] > 0 and "Triton / direct at concurrency 1" in result.stdout
