"""Speech out through Triton (``serve --demo qwen3-omni``): ``ar`` serves the tiny Qwen3-Omni's
thinker, ``speech`` its talker and ``code2wav``, ``omni`` chains them.

Every route is held to the model's own ``generate(..., return_audio=True)`` with greedy decoding in
the thinker and the talker: the same text, the same codec frames, and the waveform within
``TOLERANCE``; another voice moves that waveform more than a hundred times as far (checked here, so
the tolerance can fail)."""

from __future__ import annotations

import functools
import queue
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration
from triton_omni.demo_models import resolve_model
from triton_omni_client import OmniClient, OmniError
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

from tests.support.server import documented_metrics, metric_value

PROMPT = "a red fox"
THINKER = {"max_tokens": 8, "temperature": 0.0}
TALKER = {"talker_temperature": 0.0, "talker_max_tokens": 12, "talker_min_tokens": 3}
TOLERANCE = 1e-4  # of full scale; the streamed decode's float32 rounding is about 5e-7


@pytest.fixture(scope="module")
def speech_server(tmp_path_factory):
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            model_control_mode="explicit", demo="qwen3-omni", load_models=["ar", "speech", "omni"],
                            log_file=Path(tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    with TritonServer(options) as server:
        yield server


@functools.cache
def model() -> tuple:
    folder = resolve_model("demo:tiny-qwen3-omni")
    return AutoTokenizer.from_pretrained(folder), Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()


@functools.cache
def reference(prompt: str = PROMPT, voice: str = "ethan") -> tuple[str, str, np.ndarray, np.ndarray]:
    """The model's own generate, greedy: (the templated prompt, the reply's text, codes, waveform)."""
    tokenizer, omni = model()
    templated = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=False)
    inputs = tokenizer(templated, return_tensors="pt")
    codes = {}
    decode = omni.code2wav.chunked_decode

    def keep(frames, **options):  # generate's codec frames, as they go to its decoder
        codes["frames"] = frames[0].numpy()
        return decode(frames, **options)

    omni.code2wav.chunked_decode = keep
    try:
        with torch.no_grad():
            ids, wav = omni.generate(**inputs, speaker=voice, thinker_max_new_tokens=THINKER["max_tokens"],
                                     thinker_do_sample=False, talker_do_sample=False,
                                     thinker_eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                     talker_max_new_tokens=TALKER["talker_max_tokens"],
                                     talker_min_new_tokens=TALKER["talker_min_tokens"])
    finally:
        omni.code2wav.chunked_decode = decode
    reply = tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return templated, reply, codes["frames"], wav.flatten().numpy()


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
    omni = model()[1]
    chunks = speak_directly(speech_server.grpc_url, templated, _ar_reply_ids(speech_server.grpc_url, templated),
                            chunk_frames=3)
    audio = np.concatenate([c["audio"] for c in chunks])
    assert len(chunks) == -(-codes.shape[1] // 3) and chunks[-1]["finish_reason"] == "length"
    np.testing.assert_array_equal(np.concatenate([c["codes"] for c in chunks], axis=1), codes)
    assert np.abs(audio - wav).max() <= TOLERANCE
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


@pytest.mark.parametrize(("options", "field"), [
    ({"voice": "nobody"}, "voice"),
    ({"talker_temperature": -1.0}, "temperature"),
    ({"talker_max_tokens": 0}, "max_tokens"),
    ({"chunk_frames": 0}, "chunk_frames"),
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


def test_audio_from_a_server_that_cannot_speak_is_refused_by_name(server):
    """The shared server's omni has no speech stage."""
    with pytest.raises(OmniError) as error:
        list(OmniClient(server.grpc_url).generate(PROMPT, modalities=["text", "audio"], max_tokens=4))
    assert error.value.status == "INVALID_ARG" and "`modalities`" in str(error.value)
