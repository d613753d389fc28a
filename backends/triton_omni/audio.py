"""Input audio, decoded and checked: what a thinker hears (``input_audio``).

Each clip arrives as an encoded file (WAV, MP3, FLAC, Ogg: whatever FFmpeg, through PyAV, reads)
and becomes what a transformers user hands the model's processor: float32 samples in [-1, 1], mono
(the channels averaged, as ``librosa.load`` does), at the feature extractor's rate. A clip already
at that rate is only converted from its sample format; another rate is resampled by FFmpeg's
``swresample``. Every failure is a ``RequestValidationError`` naming the clip: a file that is not
audio, an empty one, one too large in bytes or too long in seconds, more clips than the model takes.
"""

from __future__ import annotations

import io
import itertools
from dataclasses import dataclass

import numpy as np

from triton_omni.errors import RequestValidationError


@dataclass(frozen=True)
class AudioLimits:
    max_clips: int = 0  # 0: the model hears no audio
    max_bytes: int = 25 * 1024 * 1024  # one encoded file (OpenAI's bound on an uploaded one)
    max_seconds: float = 300.0  # one clip, decoded (Qwen-Omni's processors cut clips at 300 s)
    sample_rate: int = 16000  # what the clips are resampled to: the model's feature extractor's rate


def check_clips(files: list[bytes] | None, limits: AudioLimits, field: str = "input_audio") -> list[bytes]:
    """The request's clips as files, their count and sizes checked (``[]``: none given): what can be
    refused before any is decoded, on the thread that takes requests."""
    if files is None:
        return []
    if limits.max_clips == 0:
        raise RequestValidationError(field, "this model hears no audio (it has no audio encoder)", None,
                                     show_value=False)
    if not files:
        raise RequestValidationError(field, "holds no audio clip", 0)
    if len(files) > limits.max_clips:
        raise RequestValidationError(field, f"this model takes at most {limits.max_clips} clips", len(files))
    for index, data in enumerate(files):
        if not data:
            raise RequestValidationError(f"{field}[{index}]", "is empty (zero bytes)", 0)
        if len(data) > limits.max_bytes:
            raise RequestValidationError(f"{field}[{index}]", f"is larger than {limits.max_bytes} bytes", len(data))
    return list(files)


def decode_audio(files: list[bytes] | None, limits: AudioLimits, field: str = "input_audio") -> list[np.ndarray]:
    """The request's clips as mono float32 samples at ``limits.sample_rate`` (``[]``: none given)."""
    return [_decode(data, f"{field}[{index}]", limits) for index, data in enumerate(check_clips(files, limits, field))]


def _decode(data: bytes, field: str, limits: AudioLimits) -> np.ndarray:
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise RequestValidationError(field, "holds no audio stream", container.format.name)
            samples = _samples(container, container.streams.audio[0], field, limits)
    except (av.FFmpegError, UnicodeDecodeError, ValueError) as error:
        if isinstance(error, RequestValidationError):
            raise
        raise RequestValidationError(field, f"is not an audio file this server decodes ({error})", None,
                                     show_value=False) from None
    if samples.size == 0:
        raise RequestValidationError(field, "holds no samples", 0)
    return samples


def _samples(container, stream, field: str, limits: AudioLimits) -> np.ndarray:
    """Every sample of ``stream`` as float32 at the limits' rate, its channels averaged; refused as
    soon as it passes ``limits.max_seconds``."""
    import av

    sample_rate = limits.sample_rate
    # planar float keeps each channel's samples apart: their mean is taken here, not by
    # swresample's downmix matrix (which weights the channels otherwise)
    resampler = av.AudioResampler(format="fltp", layout=stream.layout.name, rate=sample_rate)
    most = int(limits.max_seconds * sample_rate)
    chunks, count = [], 0
    for frame in itertools.chain(container.decode(stream), [None]):  # None: the resampler's last samples
        for out in resampler.resample(frame):
            chunk = out.to_ndarray().mean(axis=0)  # float32, as librosa's to_mono averages
            count += chunk.size
            if count > most:
                raise RequestValidationError(field, f"is longer than {limits.max_seconds:g} seconds",
                                             f">{limits.max_seconds:g} s")
            chunks.append(chunk)
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
