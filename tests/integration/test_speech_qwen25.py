"""Qwen2.5-Omni's speech through Triton (``serve --demo qwen2.5-omni``): ``ar`` serves the tiny
model's thinker on the transformers engine, handing on its states at every token
(``return_thinker_states``), ``speech`` its talker and ``token2wav``, ``omni`` chains them.

Held to the model's own ``generate(..., return_audio=True)``, greedy in the thinker and the talker,
``token2wav``'s noise from the same seed: the same text, the same codes, the waveform within
``TOLERANCE``; another voice, or another seed of the decoder's noise, moves the waveform more than a
hundred times as far (checked here, so that the tolerance can fail)."""

from __future__ import annotations

import base64
import functools
import io
import json
import subprocess
import sys
import time
import urllib.request
import wave
from pathlib import Path

import av
import numpy as np
import openai
import pytest
import torch
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration
from triton_omni.demo_models import resolve_model
from triton_omni.speech.demos import CODEC_EOS, CODEC_PAD
from triton_omni.speech.qwen25_talker import Qwen25Talker
from triton_omni.speech.token2wav import StreamingToken2Wav
from triton_omni_client import OmniClient, OmniError
from triton_omni_client.client import stream_infer
from triton_omni_tools.launcher import ServerOptions, free_port

from tests.support import heard
from tests.support.qwen25 import generate_seen, greedy_codes, noise, png, processor, thinker_states, user_turn
from tests.support.server import metric_value, serving_openai

PROMPT = "a red fox"
SEED = 5
THINKER = {"max_tokens": 8, "temperature": 0.0}
# enough codes that the first audio (token2wav decodes a block of 12 codes once two more follow it)
# leaves before the talker's end: the end of speech held off to max_tokens
TALKER = {"talker_temperature": 0.0, "talker_max_tokens": 60, "talker_min_tokens": 60, "talker_seed": SEED}
TOLERANCE = 1e-4  # of full scale; the streamed decode's float32 rounding is about 1e-6
PCM16 = 1 / 32767  # a 16-bit sample's step (the gateway's WAV and pcm16)
GATEWAY_TALKER = {key.removeprefix("talker_"): value for key, value in TALKER.items()}
CLIPS = ((1.2, 440, 0), (0.6, 220, 1))  # the clips a prompt with audio holds: (seconds, hertz, the noise's seed)
PICTURES = ((84, 112, 0), (56, 140, 1))  # the images a prompt with images holds: (height, width, the noise's seed)


@pytest.fixture(scope="module")
def qwen25_server(tmp_path_factory):
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            model_control_mode="explicit", demo="qwen2.5-omni", load_models=["ar", "speech", "omni"],
                            log_file=Path(tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    with serving_openai(options, chat=True) as server:
        yield server


@functools.cache
def demo():
    folder = resolve_model("demo:tiny-qwen2.5-omni")
    return AutoTokenizer.from_pretrained(folder), Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()


@functools.cache
def reference(voice: str = "Chelsie", seed: int = SEED, tones: tuple[tuple[float, int, int], ...] = (),
              pictures: tuple[tuple[int, int, int], ...] = ()) -> tuple[str, np.ndarray, np.ndarray]:
    """The model's own generate for PROMPT, greedy (after clips of ``tones``, (seconds, hertz, the
    noise's seed) each, and images of ``pictures``, (height, width, the noise's seed) each, through its
    processor): (the reply's text, its codes, its waveform)."""
    tokenizer, model = demo()
    seen = {}
    if tones or pictures:
        clips = [heard.as_heard(heard.tone(*tone)) for tone in tones]
        images = [noise(*picture) for picture in pictures]
        inputs = processor(resolve_model("demo:tiny-qwen2.5-omni"))(
            text=user_turn(tokenizer, PROMPT, len(clips), images=len(images)), audio=clips or None,
            images=images or None, return_tensors="pt")
        # generate hands its talker the pixels too, which the talker's generate refuses (transformers 5.19)
        seen = {"talker_pixel_values": None} if images else {}
    else:
        ids = tokenizer(user_turn(tokenizer, PROMPT, 0), return_tensors="pt").input_ids
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    torch.manual_seed(seed)  # the only draw: token2wav's noise (the thinker and the talker are greedy)
    reply, seen, wav = generate_seen(
        model, inputs, voice, thinker_do_sample=False, thinker_max_new_tokens=THINKER["max_tokens"],
        talker_do_sample=False, talker_max_new_tokens=TALKER["talker_max_tokens"],
        talker_min_new_tokens=TALKER["talker_min_tokens"], talker_eos_token_id=[CODEC_PAD, CODEC_EOS], **seen)
    return tokenizer.decode(reply, skip_special_tokens=True), np.array(seen["codes"]), wav.numpy()


def spoken(events) -> tuple[str, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """(text, audio, codes, each audio chunk's (codes, samples)) of an ``OmniClient.generate`` stream."""
    events = list(events)
    chunks = [e for e in events if e.audio is not None]
    return ("".join(e.text for e in events if e.text), np.concatenate([e.audio for e in chunks]),
            np.concatenate([e.audio_codes for e in chunks], axis=1)[0],
            [(e.audio_codes.shape[1], len(e.audio)) for e in chunks])


def test_omni_speaks_as_the_models_generate(qwen25_server):
    reply, codes, wav = reference()
    assert len(codes) > 36  # long enough that audio could leave before the talker's end
    for other in (reference(voice="Ethan")[2], reference(seed=SEED + 1)[2]):
        n = min(len(other), len(wav))
        assert len(other) != len(wav) or np.abs(other[:n] - wav[:n]).max() > 100 * TOLERANCE
    client = OmniClient(qwen25_server.grpc_url)
    for stream in (True, False):
        text, audio, served_codes, frames = spoken(client.generate(
            PROMPT, modalities=["text", "audio"], stream=stream, voice="chelsie", **THINKER, **TALKER))
        assert text == reply
        np.testing.assert_array_equal(served_codes, codes)
        assert audio.shape == wav.shape and np.abs(audio - wav).max() <= TOLERANCE
        if stream:  # the first audio left before the talker had drawn every code, each chunk with the codes
            # whose samples it ends (480 a code): token2wav's held-back context is not counted in it
            assert len(frames) > 1 and frames[0][0] < len(codes)
            codes_out, samples_out = np.cumsum(frames, axis=0).T
            np.testing.assert_array_equal(codes_out[:-1], samples_out[:-1] // 480)
    _, audio, _, _ = spoken(client.generate(PROMPT, modalities=["audio"], voice="ethan", **THINKER, **TALKER))
    assert np.abs(audio - reference(voice="Ethan")[2]).max() <= TOLERANCE


def test_a_spoken_reply_to_audio_is_the_models_through_omni_and_the_gateway(qwen25_server):
    """Speech in, speech out: ``omni`` (gRPC, ``input_audio``) and the gateway (the ``openai`` SDK,
    ``input_audio`` parts) give generate's text, codes and waveform for the same clips. The talker
    reads zeros of the thinker's layer-0 input at the audio (tests/unit/test_audio_input_qwen25.py
    shows other codes without them). Another clip gives another text and other codes (half of them;
    the tiny ``token2wav`` moves its waveform little for other codes: the voice and the seed move it,
    test_omni_speaks_as_the_models_generate)."""
    reply, codes, wav = reference(tones=CLIPS)
    other_reply, other_codes, _ = reference(tones=((1.2, 880, 2), CLIPS[1]))
    assert other_reply != reply and (other_codes != codes).mean() > 0.3
    files = [heard.wav_bytes(heard.tone(seconds, hertz, seed)) for seconds, hertz, seed in CLIPS]
    text, audio, served_codes, _ = spoken(OmniClient(qwen25_server.grpc_url).generate(
        PROMPT, modalities=["text", "audio"], input_audio=files, voice="chelsie", **THINKER, **TALKER))
    assert text == reply
    np.testing.assert_array_equal(served_codes, codes)
    assert audio.shape == wav.shape and np.abs(audio - wav).max() <= TOLERANCE

    transcript, samples = chat_spoken(qwen25_server, audio_parts(files))
    assert transcript == reply
    assert samples.shape == wav.shape and np.abs(samples - wav).max() <= TOLERANCE + PCM16


def audio_parts(clips: list[bytes]) -> list[dict]:
    return [{"type": "input_audio", "input_audio": {"data": base64.b64encode(f).decode(), "format": "wav"}}
            for f in clips]


def image_parts(images: list[bytes]) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(f).decode()}"}}
            for f in images]


def chat_spoken(server, parts: list[dict]) -> tuple[str, np.ndarray]:
    """The gateway's spoken chat reply (the ``openai`` SDK, a WAV) to ``parts`` then PROMPT: its
    transcript and its samples."""
    answer = server.openai.chat.completions.create(
        model="ar", messages=[{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}],
        modalities=["text", "audio"], audio={"voice": "chelsie", "format": "wav"},
        max_tokens=THINKER["max_tokens"], temperature=0.0, extra_body={"talker": GATEWAY_TALKER})
    with av.open(io.BytesIO(base64.b64decode(answer.choices[0].message.audio.data))) as container:
        samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)])
    samples = samples.astype(np.float32) / 32768 if samples.dtype == np.int16 else samples
    return answer.choices[0].message.audio.transcript, samples


def seen_reply(url: str, text: str, images: list[bytes]) -> str:
    """``ar``'s greedy reply (over gRPC, tritonclient) to a prompt with ``images`` (one file per marker)."""
    values = {"text_input": np.array([text.encode()], dtype=object), "images": np.array(images, dtype=object),
              "max_tokens": np.array([THINKER["max_tokens"]], np.int32), "temperature": np.array([0.0], np.float32),
              "exclude_input_in_output": np.array([True])}
    inputs = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32",
                                                                 np.dtype(np.float32): "FP32"}.get(value.dtype, "BOOL"))
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    results = list(stream_infer(url, "ar", inputs, timeout_s=120))
    return "".join(v.decode() for r in results for v in r.as_numpy("text_output"))


def test_the_thinker_sees_images_through_ar_and_the_gateway_as_generate_does(qwen25_server):
    """Image in, text out: ``ar`` over gRPC (``images``), ``omni`` (``images`` with modalities
    ``["text"]``) and the gateway's chat (``image_url`` parts,
    base64 ``data:`` URLs, through the ``openai`` SDK) give ``thinker.generate``'s reply to the
    processor's pixels; another image gives another reply (tests/unit/test_image_input.py holds the
    positions and embeddings to the thinker's own)."""
    tokenizer, model = demo()
    made = processor(resolve_model("demo:tiny-qwen2.5-omni"))
    images = [noise(84, 112, 0), noise(56, 140, 1)]
    text = user_turn(tokenizer, PROMPT, 0, images=2)
    inputs = made(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.thinker.generate(**inputs, max_new_tokens=THINKER["max_tokens"], do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    files = [png(image) for image in images]
    assert seen_reply(qwen25_server.grpc_url, text, files) == reply
    assert seen_reply(qwen25_server.grpc_url, text, [png(noise(84, 112, 7)), files[1]]) != reply
    events = OmniClient(qwen25_server.grpc_url).generate(PROMPT, modalities=["text"], images=files, **THINKER)
    assert "".join(e.text for e in events if e.text) == reply  # omni: the user turn of the model's template

    parts = image_parts(files)
    chat = {"model": "ar", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}],
            "max_tokens": THINKER["max_tokens"], "temperature": 0.0}
    answer = qwen25_server.openai.chat.completions.create(**chat)
    assert answer.choices[0].message.content == reply
    not_an_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
    with pytest.raises(openai.BadRequestError) as error:  # ar's refusal of images[1], named by its part
        qwen25_server.openai.chat.completions.create(**chat | {"messages": [{"role": "user", "content": [
            parts[0], not_an_image, {"type": "text", "text": PROMPT}]}]})
    assert error.value.body["param"] == "messages.0.content.1" and "not an image file" in error.value.body["message"]
    assert qwen25_server.openai.chat.completions.create(**chat).choices[0].message.content == reply


def test_a_spoken_reply_to_images_is_the_models_through_omni_and_the_gateway(qwen25_server):
    """Image and audio in, speech out: ``omni`` (gRPC, ``images`` and ``input_audio`` with modalities
    ``["text", "audio"]``) and the gateway's chat (the ``openai`` SDK, ``image_url`` and ``input_audio``
    parts) give generate's text, codes and waveform. The talker reads zeros of the thinker's layer-0
    input at the images (tests/unit/test_image_input.py shows those states far from generate's
    without them). Another image gives other codes (a few: the tiny talker soon repeats one code; the
    tiny ``token2wav`` moves its waveform little for them, the voice and the seed move it:
    test_omni_speaks_as_the_models_generate)."""
    reply, codes, wav = reference(tones=CLIPS[:1], pictures=PICTURES)
    _, other_codes, _ = reference(tones=CLIPS[:1], pictures=((84, 112, 7), PICTURES[1]))
    assert not np.array_equal(other_codes, codes)
    files = [png(noise(*picture)) for picture in PICTURES]
    clips = [heard.wav_bytes(heard.tone(*CLIPS[0]))]
    text, audio, served_codes, _ = spoken(OmniClient(qwen25_server.grpc_url).generate(
        PROMPT, modalities=["text", "audio"], images=files, input_audio=clips, voice="chelsie", **THINKER, **TALKER))
    assert text == reply
    np.testing.assert_array_equal(served_codes, codes)
    assert audio.shape == wav.shape and np.abs(audio - wav).max() <= TOLERANCE

    transcript, samples = chat_spoken(qwen25_server, audio_parts(clips) + image_parts(files))
    assert transcript == reply
    assert samples.shape == wav.shape and np.abs(samples - wav).max() <= TOLERANCE + PCM16


def test_a_reply_of_one_token_is_spoken_as_no_audio(qwen25_server):
    """The thinker's reply is its end alone (one token asked for): nothing to speak (the model's own
    generate fails there), the text still comes."""
    events = list(OmniClient(qwen25_server.grpc_url).generate(PROMPT, modalities=["text", "audio"], max_tokens=1,
                                                              temperature=0.0, **TALKER))
    assert events and not any(e.audio is not None and e.audio.size for e in events)


def test_bad_input_is_refused_by_name_and_the_next_request_is_served(qwen25_server):
    client = OmniClient(qwen25_server.grpc_url)
    with pytest.raises(OmniError, match="voice"):
        list(client.generate(PROMPT, modalities=["audio"], voice="nobody", **THINKER, **TALKER))
    # the speech stage called without the thinker's states it reads
    with grpcclient.InferenceServerClient(qwen25_server.grpc_url) as triton:
        inputs = []
        for name, value, kind in (("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
                                  ("reply_ids", np.array([5, 6], dtype=np.int64), "INT64")):
            tensor = grpcclient.InferInput(name, list(value.shape), kind)
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        errors = []
        triton.start_stream(callback=lambda result, error: errors.append(error))
        triton.async_stream_infer("speech", inputs)
        triton.stop_stream()
    assert errors and errors[0] is not None and "thinker_states" in str(errors[0])
    text, _, codes, _ = spoken(client.generate(PROMPT, modalities=["text", "audio"], **THINKER, **TALKER))
    assert text == reference()[0] and np.array_equal(codes, reference()[1])


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767


def test_the_gateway_speaks_a_chat_as_the_models_generate(qwen25_server):
    """``/v1/chat/completions`` with audio through the ``openai`` SDK: the transcript is generate's text
    and the audio its waveform (to 16-bit PCM's step), whole and streamed; the voices are the model's."""
    reply, _, wav = reference()
    chat = {"model": "ar", "messages": [{"role": "user", "content": PROMPT}], "modalities": ["text", "audio"],
            "max_tokens": THINKER["max_tokens"], "temperature": 0.0, "extra_body": {"talker": GATEWAY_TALKER}}
    answer = qwen25_server.openai.chat.completions.create(audio={"voice": "chelsie", "format": "wav"}, **chat)
    audio = answer.choices[0].message.audio
    assert audio.transcript == reply
    with av.open(io.BytesIO(base64.b64decode(audio.data))) as container:
        samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)])
    samples = samples.astype(np.float32) / 32768 if samples.dtype == np.int16 else samples
    assert samples.shape == wav.shape and np.abs(samples - wav).max() <= TOLERANCE + PCM16
    transcript, data = "", b""
    for chunk in qwen25_server.openai.chat.completions.create(audio={"voice": "chelsie", "format": "pcm16"},
                                                             stream=True, **chat):
        if chunk.choices and chunk.choices[0].delta.audio is not None:
            transcript += chunk.choices[0].delta.audio.transcript or ""
            data += base64.b64decode(chunk.choices[0].delta.audio.data or "")
    assert transcript == reply and np.abs(pcm16(data) - wav).max() <= TOLERANCE + PCM16
    voices = json.loads(urllib.request.urlopen(f"{qwen25_server.gateway_url}/v1/audio/voices").read())
    assert voices == {"voices": ["Chelsie", "Ethan"]}


def spoken_input(text: str, voice: str) -> np.ndarray:
    """``text`` spoken as the reply to itself as a user turn, from the model's parts driven as its
    generate drives them: the thinker's states over the prompt and the text, the talker greedy, the
    decode from the same seed."""
    tokenizer, model = demo()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    reply = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    talker = Qwen25Talker(model.talker, model.thinker.get_input_embeddings(), model.speaker_map, model.config)
    prompt_of = talker.prompt(ids[0].tolist(), reply, voice, states=thinker_states(model, ids, reply))
    codes = greedy_codes(talker, prompt_of, TALKER["talker_max_tokens"], TALKER["talker_min_tokens"])
    stream = StreamingToken2Wav(model.token2wav).stream(*talker.voice_conditioning(voice),
                                                       torch.Generator().manual_seed(SEED))
    return stream.add(codes, final=True).numpy()


def test_the_speech_endpoint_speaks_its_input_as_the_models_parts_do(qwen25_server):
    """``/v1/audio/speech``: the thinker reads the input (its states, which the talker reads), the
    talker speaks it; the WAV's samples are the model's parts' (to 16-bit PCM's step), another
    voice's far from them."""
    speech = {"model": "speech", "input": "a red fox", "extra_body": {"talker": GATEWAY_TALKER}}
    expected = spoken_input("a red fox", "chelsie")
    assert np.abs(spoken_input("a red fox", "ethan") - expected).max() > 100 * TOLERANCE
    wav = qwen25_server.openai.audio.speech.create(response_format="wav", voice="chelsie", **speech).content
    samples = pcm16(wav[44:])
    assert samples.shape == expected.shape and np.abs(samples - expected).max() <= TOLERANCE + PCM16


@pytest.mark.parametrize("perceived", [False, True], ids=["text", "images and audio"])
def test_the_cli_writes_the_spoken_reply(qwen25_server, tmp_path, perceived):
    """`omni-triton generate --modalities text,audio --out reply.wav` (with `--image` and `--audio`
    files the thinker reads before the prompt): generate's text and waveform."""
    pictures, tones = (PICTURES, CLIPS[:1]) if perceived else ((), ())
    reply, _, expected = reference(tones=tones, pictures=pictures)
    inputs = []
    for index, picture in enumerate(pictures):
        (tmp_path / f"{index}.png").write_bytes(png(noise(*picture)))
        inputs += ["--image", str(tmp_path / f"{index}.png")]
    for index, tone in enumerate(tones):
        (tmp_path / f"{index}.wav").write_bytes(heard.wav_bytes(heard.tone(*tone)))
        inputs += ["--audio", str(tmp_path / f"{index}.wav")]
    talker = [f"--param={key}={value}" for key, value in TALKER.items()]
    done = subprocess.run([str(Path(sys.executable).parent / "omni-triton"), "generate", PROMPT, "--url",
                           qwen25_server.grpc_url, "--modalities", "text,audio", "--out", str(tmp_path / "reply.wav"),
                           "--max-tokens", str(THINKER["max_tokens"]), "--param=temperature=0",
                           "--param=voice=chelsie", *talker, *inputs], check=True, capture_output=True, text=True)
    assert done.stdout.startswith(reply) and "wrote" in done.stdout
    with wave.open(str(tmp_path / "reply.wav")) as file:
        samples = pcm16(file.readframes(file.getnframes()))
    assert samples.shape == expected.shape and np.abs(samples - expected).max() <= TOLERANCE + PCM16


def test_a_client_that_leaves_mid_speech_stops_the_talker_and_the_decoder(qwen25_server):
    """A long utterance (the end of speech held off), left after its first audio: the speech stage
    counts the request cancelled, and its audio stops growing."""
    speech = lambda name, **labels: metric_value(qwen25_server, name, model="speech", **labels)  # noqa: E731
    before = speech("omni_speech_requests_total", outcome="cancelled")
    events = OmniClient(qwen25_server.grpc_url).generate(
        PROMPT, modalities=["audio"], **THINKER, talker_temperature=0.0, talker_max_tokens=900,
        talker_min_tokens=900, chunk_frames=12)
    next(e for e in events if e.audio is not None)
    events.close()
    deadline = time.monotonic() + 30
    while speech("omni_speech_requests_total", outcome="cancelled") == before:
        assert time.monotonic() < deadline, "the speech stage never saw the cancellation"
        time.sleep(0.2)
    time.sleep(0.5)  # a decode under way when it was cancelled ends
    spoken_seconds = speech("omni_speech_audio_seconds_total")
    time.sleep(1.0)
    assert speech("omni_speech_audio_seconds_total") == spoken_seconds
    assert spoken_seconds < 900 / 50  # far from the whole utterance (50 codes a second)


def test_the_speech_bench_measures_this_server(qwen25_server, tmp_path):
    """``benchmarks/speech.py --model qwen2.5-omni --url`` against this server and the tiny demo's own
    generate: each figure printed at each concurrency, never checked (docs/benchmarks.md quotes a GPU's)."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "speech.json"
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "speech.py"), "--model", "qwen2.5-omni",
                             "--url", qwen25_server.grpc_url, "--metrics-url", qwen25_server.metrics_url,
                             "--concurrency", "1,2", "--requests", "2", "--direct-requests", "1",
                             "--prompt-tokens", "20", "--text-tokens", "6", "--audio-seconds", "1.0",
                             "--with-text", "--json", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    for level in ("1", "2"):
        found = report["triton"][level]
        assert found["requests"] == 2 and found["requests_per_s"] > 0
        assert abs(found["audio_s"] - 1.0) < 0.05  # 50 codes, 480 samples each
        assert min(found["ttfa_ms"], found["ttft_ms"], found["rtf"]) > 0
        assert min(found["stages"][name] for name in ("ar_ttft_ms", "speech_ttfa_ms")) > 0
    assert abs(report["direct"]["audio_s"] - 1.0) < 0.05 and "Triton / direct at concurrency 1" in result.stdout
