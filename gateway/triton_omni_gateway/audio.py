"""Spoken replies: ``/v1/audio/speech`` and the audio of ``/v1/chat/completions``.

Both go to the ``speech`` model, which speaks a thinker's reply: its prompt
(the conversation in the model's chat template) and the reply's token ids.
A chat asks the thinker (``ar``) for the reply first, as ``omni`` does;
``/v1/audio/speech`` has its reply already, the ``input`` to speak, which the
talker reads as the assistant's answer to a user turn holding the same text.
The samples come as the talker speaks them and are encoded as they come
(PyAV's encoders; WAV and raw PCM written here), so a streamed answer's
first bytes leave before the talker has finished.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
import secrets
import struct
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np

from triton_omni_gateway.errors import OpenAIError
from triton_omni_gateway.triton import Triton, first

SPEECH_MODEL = "speech"
SPEECH_BACKEND = "omni_speech"  # what serves a speech model: /v1/audio/speech's `model` names one
# response_format (and chat's audio.format) -> (PyAV container, codec, media type); wav and pcm are written here
ENCODED = {"mp3": ("mp3", "libmp3lame", "audio/mpeg"), "flac": ("flac", "flac", "audio/flac"),
           "opus": ("ogg", "libopus", "audio/ogg"), "aac": ("adts", "aac", "audio/aac")}
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "pcm16": "audio/pcm"} | {
    name: media for name, (_, _, media) in ENCODED.items()}
# what a speech input refused by the model is called in the API's bodies
SPEECH_FIELDS = {"text_input": "input", "reply_ids": "input", "voice": "voice"}


async def speak(triton: Triton, prompt: str, reply_ids: list[int], voice: str, model: str = SPEECH_MODEL,
                talker: dict[str, Any] | None = None, heard: tuple[list[int], np.ndarray] | None = None,
                states: tuple[list[int], np.ndarray] | None = None,
                positions: np.ndarray | None = None) -> AsyncIterator[tuple[np.ndarray, int]]:
    """The reply's samples (float32) and their rate, chunk by chunk as the speech model sends them;
    ``talker``: its sampling options, by the speech model's names; ``heard``: a prompt with audio or
    images as the thinker read it, and its states there (``ar``'s ``return_heard_states``); ``states``:
    the prompt as the thinker read it and its states at every prompt and reply token but the last
    (``ar``'s ``return_thinker_states``), which a Qwen2.5-Omni talker reads; ``positions``: with
    either, a prompt with images' rotary positions (``ar``'s ``prompt_positions``)."""
    values = {"text_input": prompt, "reply_ids": np.asarray(reply_ids, dtype=np.int64), "voice": voice,
              **(talker or {})}
    if heard is not None:
        values |= {"prompt_ids": np.asarray(heard[0], dtype=np.int64),
                   "heard_states": np.ascontiguousarray(heard[1], dtype=np.float32)}
    if states is not None:
        values |= {"prompt_ids": np.asarray(states[0], dtype=np.int64),
                   "thinker_states": np.ascontiguousarray(states[1], dtype=np.float32)}
    if positions is not None:
        values["prompt_positions"] = np.ascontiguousarray(positions, dtype=np.int64)
    ended = lambda result: result.as_numpy("finish_reason") is not None  # noqa: E731
    try:
        async with aclosing(triton.stream(model, values, ended)) as results:
            async for result in results:
                audio = result.as_numpy("audio")
                if audio is not None:
                    yield audio.astype(np.float32).reshape(-1), int(first(result, "sample_rate"))
    except OpenAIError as error:
        if error.param in SPEECH_FIELDS:
            error.param = SPEECH_FIELDS[error.param]
        raise


class Encoder:
    """Samples in, the encoded file's bytes out as they are made (for a stream), and the rest at ``close``."""

    def __init__(self, format: str, rate: int, streamed: bool = False):
        self.format, self.rate, self.streamed = format, rate, streamed
        self._header = format == "wav"
        self._container = None
        self._samples: list[np.ndarray] = []  # a whole (not streamed) WAV's, for its exact header
        if format in ENCODED:
            import av

            container, codec, _ = ENCODED[format]
            self._buffer = io.BytesIO()
            self._container = av.open(self._buffer, "w", format=container)
            self._stream = self._container.add_stream(codec, rate=48000 if codec == "libopus" else rate)
            self._stream.layout = "mono"
            self._sent = 0

    def add(self, samples: np.ndarray) -> bytes:
        if self._container is None:
            pcm = _pcm16(samples)
            if self.format == "wav" and not self.streamed:
                self._samples.append(pcm)
                return b""
            if self._header:  # a streamed WAV: its length unknown, the header says "as long as it goes"
                self._header = False
                return _wav_header(self.rate, 0xFFFFFFFF - 36) + pcm
            return pcm
        import av

        frame = av.AudioFrame.from_ndarray(samples.astype(np.float32)[None], format="flt", layout="mono")
        frame.sample_rate = self.rate
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._taken()

    def close(self) -> bytes:
        if self._container is None:
            if self.format == "wav" and not self.streamed:
                pcm = b"".join(self._samples)
                return _wav_header(self.rate, len(pcm)) + pcm
            return _wav_header(self.rate, 0xFFFFFFFF - 36) if self._header else b""
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._taken()

    def _taken(self) -> bytes:
        data = self._buffer.getvalue()
        new, self._sent = data[self._sent:], len(data)
        return new


def _pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def _wav_header(rate: int, data_bytes: int) -> bytes:
    """A 16-bit mono PCM WAV header for ``data_bytes`` of samples."""
    return (b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate,
            rate * 2, 2, 16) + b"data" + struct.pack("<I", data_bytes))


async def encoded(chunks: AsyncIterator[tuple[np.ndarray, int]], format: str) -> AsyncIterator[bytes]:
    """The file's bytes as the chunks come (encoding off the event loop)."""
    encoder = None
    async for samples, rate in chunks:
        if encoder is None:
            encoder = Encoder(format, rate, streamed=True)
        if data := await asyncio.to_thread(encoder.add, samples):
            yield data
    if encoder is not None and (data := await asyncio.to_thread(encoder.close)):
        yield data


async def whole(chunks: AsyncIterator[tuple[np.ndarray, int]], format: str) -> bytes:
    samples, rate = [], 24000
    async for chunk, chunk_rate in chunks:
        samples.append(chunk)
        rate = chunk_rate
    encoder = Encoder(format, rate)
    return await asyncio.to_thread(lambda: encoder.add(np.concatenate(samples) if samples else np.zeros(0))
                                   + encoder.close())


def sse(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """``stream_format: sse``: each piece of the file as a ``speech.audio.delta`` event, then ``done``."""
    async def events():
        async for data in chunks:
            yield f"data: {json.dumps({'type': 'speech.audio.delta', 'audio': base64.b64encode(data).decode()})}\n\n"
        yield f"data: {json.dumps({'type': 'speech.audio.done'})}\n\n"
    return events()


@functools.cache  # asked at every spoken request: the checkpoint's config read once
def reads_states(folder: str | None) -> bool:
    """Whether the speaking checkpoint's talker reads the thinker's states at every token (a
    Qwen2.5-Omni's), which the thinker then hands on (``return_thinker_states``)."""
    return folder is not None and json.loads((Path(folder) / "config.json").read_text()).get("model_type") \
        == "qwen2_5_omni"


class Voices:
    """The speech model's voices, from its checkpoint: Qwen3-Omni's config (``talker_config.speaker_id``),
    Qwen2.5-Omni's ``spk_dict.pt``."""

    def __init__(self, folder: str | None):
        self.folder = folder

    def names(self) -> list[str]:
        if self.folder is None:
            return []
        if reads_states(self.folder):
            return sorted(_speaker_names(Path(self.folder) / "spk_dict.pt"))
        config = json.loads((Path(self.folder) / "config.json").read_text())
        return sorted((config.get("talker_config") or {}).get("speaker_id") or {})


def _speaker_names(path: Path) -> list[str]:
    """The voices of a Qwen2.5-Omni ``spk_dict.pt`` (a torch zip: a pickled dict, a voice's name to its
    tensors), read without torch (the gateway loads no ML library): the dict's keys, its tensors left
    unbuilt."""
    import pickle
    import zipfile

    class Names(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if module == "collections" and name == "OrderedDict":
                return dict
            return lambda *args, **kwargs: None  # torch's rebuild functions and storages: not needed

        def persistent_load(self, pid):
            return None

    with zipfile.ZipFile(path) as archive:
        [data] = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        return list(Names(io.BytesIO(archive.read(data))).load())


def audio_id() -> str:
    return f"audio_{secrets.token_hex(12)}"


def expires_at() -> int:
    """When a chat reply's audio stops being referable (OpenAI's: an hour); this gateway keeps none."""
    return int(time.time()) + 3600


def chat_audio(data: bytes, transcript: str) -> dict[str, Any]:
    return {"id": audio_id(), "data": base64.b64encode(data).decode(), "expires_at": expires_at(),
            "transcript": transcript}


def no_speech_model(model: str, speaking: list[str] | None = None) -> OpenAIError:
    """``model`` is not a speech model; ``speaking``: the ones this server serves, named to the user."""
    if speaking:
        named = ", ".join(f"'{name}'" for name in speaking)
        return OpenAIError(400, f"model '{model}' does not speak: the speech model{'s' * (len(speaking) > 1)} "
                           f"here: {named}", param="model", code="model_not_found")
    return OpenAIError(400, f"model '{model}' does not speak: this server serves no speech model (serve a speech "
                       "demo, e.g. omni-triton serve --demo qwen3-omni)", param="model", code="model_not_found")


async def spoken_chat(triton: Triton, model: str, prompt: str, sampling: dict[str, Any], voice: str, format: str,
                      stream: bool, talker: dict[str, Any], speech_model: str = SPEECH_MODEL,
                      audio: list[bytes] | None = None, states: bool = False, images: list[bytes] | None = None):
    """A chat's reply, spoken: the thinker's (``model``) text, then its audio. Whole: OpenAI's
    ``message.audio`` (``data`` the file in ``format``, ``transcript`` the text). Streamed: the
    transcript's deltas as ``delta.audio.transcript`` while the thinker writes, then the samples as
    ``delta.audio.data`` (16-bit PCM) while the talker speaks. ``audio``: the files the prompt's
    audio markers stand for; the thinker hands on its states at them, which the talker reads.
    ``states``: the talker reads the thinker's states at every token (Qwen2.5-Omni's), asked for here,
    the audio's among them (in place of the states at the audio alone). ``images``: the files the
    prompt's image markers stand for, read as the audio is (and the prompt's rotary positions with
    them, which the talker numbers its own from)."""
    from triton_omni_gateway.text import deltas

    ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
    state = {"text": "", "ids": [], "reason": "stop", "prompt_tokens": 0, "tokens": 0, "heard": None,
             "prompt_ids": [], "states": [], "positions": None}

    async def reply() -> AsyncIterator[str]:
        async with aclosing(deltas(triton, model, prompt, sampling, token_ids=True, audio=audio,
                                   heard=bool(audio or images) and not states, states=states,
                                   images=images)) as parts:
            async for delta in parts:
                if delta.heard_states is not None:
                    state["heard"] = (delta.prompt_token_ids, delta.heard_states)
                if delta.prompt_positions is not None:
                    state["positions"] = delta.prompt_positions
                if delta.thinker_states is not None:
                    state["prompt_ids"] = state["prompt_ids"] or delta.prompt_token_ids
                    state["states"].append(delta.thinker_states)
                state["text"] += delta.texts[0] if delta.texts else ""
                state["ids"] += delta.token_ids
                state["tokens"] += delta.tokens[0] if delta.tokens else 0
                state["prompt_tokens"] = delta.prompt_tokens or state["prompt_tokens"]
                if delta.finish_reasons:
                    state["reason"] = "length" if delta.finish_reasons[0] == "length" else "stop"
                if delta.texts and delta.texts[0]:
                    yield delta.texts[0]

    def usage() -> dict[str, int]:
        return {"prompt_tokens": state["prompt_tokens"], "completion_tokens": state["tokens"],
                "total_tokens": state["prompt_tokens"] + state["tokens"]}

    def spoken() -> AsyncIterator[tuple[np.ndarray, int]]:
        thinker = (state["prompt_ids"], np.concatenate(state["states"])) if state["states"] else None
        return speak(triton, prompt, state["ids"], voice, speech_model, talker, state["heard"], thinker,
                     state["positions"])

    if not stream:
        async for _ in reply():
            pass
        data = await whole(spoken(), "pcm" if format == "pcm16" else format)
        message = {"role": "assistant", "content": None, "audio": chat_audio(data, state["text"])}
        return {"id": ident, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": state["reason"]}],
                "usage": usage()}

    ident_audio = audio_id()
    texts = reply()
    first_text = await anext(texts, "")  # a refused request is a 4xx, not an event

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        return f"data: {json.dumps(body)}\n\n"

    async def events() -> AsyncIterator[str]:
        """The chunks. ``close`` (the response's background task, which runs after a client that left
        too: Starlette stops iterating where it stands) closes them, and with them the speech stream
        they read, then the thinker's (``texts``, read here from its second text on)."""
        try:
            yield chunk({"role": "assistant", "content": None, "audio": {"id": ident_audio, "transcript": ""}})
            if first_text:
                yield chunk({"audio": {"id": ident_audio, "transcript": first_text}})
            async for text in texts:
                yield chunk({"audio": {"id": ident_audio, "transcript": text}})
            async with aclosing(encoded(spoken(), "pcm")) as pcm:
                async for data in pcm:
                    yield chunk({"audio": {"id": ident_audio, "data": base64.b64encode(data).decode()}})
            yield chunk({"audio": {"id": ident_audio, "expires_at": expires_at()}}, state["reason"])
        except OpenAIError as error:
            yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"

    chunks = events()

    async def close() -> None:
        await chunks.aclose()
        await texts.aclose()

    return chunks, close



async def read_as_thinker(triton: Triton, thinker: str, prompt: str, text: str,
                          tokenizer) -> tuple[list[int], list[int], np.ndarray]:
    """What a Qwen2.5-Omni talker reads of a reply it is handed rather than one its thinker wrote
    (``/v1/audio/speech``'s ``input``): the thinker (the model ``thinker``) reads the prompt and the
    text after it, one token asked of it, and hands on its states there. The prompt's ids and the
    reply's (the text's, then the end of the turn), and the states at the prompt and the reply but
    its last token."""
    from triton_omni_gateway.text import deltas

    read: list[int] = []
    found: list[np.ndarray] = []
    async with aclosing(deltas(triton, thinker, prompt + text, {"max_tokens": 1, "temperature": 0.0},
                               states=True)) as parts:
        async for delta in parts:
            read = read or delta.prompt_token_ids
            if delta.thinker_states is not None:
                found.append(delta.thinker_states)
    prompt_ids = tokenizer(prompt)["input_ids"]
    if read[:len(prompt_ids)] != prompt_ids or len(read) == len(prompt_ids):
        raise OpenAIError(400, "the model's tokenizer joins the input's first characters to the prompt before "
                          "it; begin the input with a word", param="input")
    reply = [*read[len(prompt_ids):], tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return prompt_ids, reply, np.concatenate(found)
