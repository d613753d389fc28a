"""A video's frames as an MP4 file and back: H.264 in yuv420p (what browsers and players take),
through PyAV's own FFmpeg (imported when asked; the client needs no torch and no system FFmpeg).

The gateway's ``/v1/videos/{id}/content`` and ``omni-triton generate-video`` write with it; tests
and users read the frames back with ``decode_mp4``. H.264 is lossy: a decoded frame is near its
source (``crf`` sets how near), never equal to it."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

CRF = 18  # x264's constant rate factor: 18 is "visually lossless" in its documentation (0 is lossless)
# x264's speed preset. At one CRF every preset aims at the same quality; a slower one searches more
# to spend fewer bytes. A served video waits for its encode (an 81-frame 480p video is seconds of
# CPU at x264's default, "medium"): "veryfast" encodes it several times faster, for files about a
# fifth larger on smooth content (benchmarks/video_encode.py prints both on this host).
PRESET = "veryfast"
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")


def encode_mp4(frames: np.ndarray, fps: float, crf: int = CRF, preset: str = PRESET, threads: str = "FRAME") -> bytes:
    """``frames`` ``[F, H, W, 3]`` uint8 (even H and W: yuv420p halves the chroma) as an MP4 file
    played at ``fps``, at x264's ``crf`` and speed ``preset``. ``threads``: x264's threading, by
    frames as the ffmpeg CLI runs it, or ``SLICE`` (PyAV's default: each frame's rows spread over
    the threads, which keeps far fewer of a machine's cores busy; benchmarks/video_encode.py prints
    both). Frame-threaded x264 is still deterministic at one thread count (one per CPU here):
    the same frames give the same file on the same machine."""
    import av

    _, height, width, channels = frames.shape
    if channels != 3 or height % 2 or width % 2:
        raise ValueError(f"frames must be [F, H, W, 3] with even H and W, got {list(frames.shape)}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of x264's: {', '.join(PRESETS)}; got {preset!r}")
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf), "preset": preset}
        stream.codec_context.thread_type = threads
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())  # what the encoder still holds
    return out.getvalue()


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """An MP4 file's frames ``[F, H, W, 3]`` uint8 and its frame rate."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)
