"""What a served video's MP4 costs the gateway: x264's encode of one video's frames at each speed
preset (``triton_omni_client.video.encode_mp4``, the CRF the gateway uses), in seconds and KiB,
for two kinds of frames: smooth moving gradients (what a trained model's video is like) and
uniform noise (what the realistic presets' random weights make, the encoder's worst case).

Why: a ``/v1/videos`` client waits for the encode after the frames are made, so the preset is
a trade of that wait against the file's size; the gateway's ``--video-preset`` sets it. The last
row of each kind is the default preset with x264's threads over each frame's slices (PyAV's
default) instead of over frames (the gateway's).

    .venv/bin/python benchmarks/video_encode.py                      # 832x480, 81 frames
    .venv/bin/python benchmarks/video_encode.py --size 1280x704 --frames 121
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from triton_omni_client.video import CRF, PRESET, encode_mp4


def frames(kind: str, count: int, height: int, width: int) -> np.ndarray:
    if kind == "noise":
        return np.random.default_rng(0).integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([np.stack([(x + 4 * t) % 256, (y + 2 * t) % 256, ((x + y) // 2 + t) % 256], -1)
                     for t in range(count)]).astype(np.uint8)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="832x480", help="WIDTHxHEIGHT")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--presets", default=f"medium,{PRESET},ultrafast", help="comma-separated x264 presets")
    parser.add_argument("--rounds", type=int, default=2, help="encodes per preset (the best is printed)")
    args = parser.parse_args(argv)
    width, height = (int(side) for side in args.size.split("x"))
    print(f"x264 at CRF {CRF}, {args.frames} frames of {width}x{height}; the gateway's default preset: {PRESET}")
    print(f"{'frames':<8} {'preset':<10} {'threads':<8} {'seconds':>8} {'KiB':>8}")
    for kind in ("smooth", "noise"):
        video = frames(kind, args.frames, height, width)
        for preset, threads in [(p, "FRAME") for p in args.presets.split(",")] + [(PRESET, "SLICE")]:
            best, size = float("inf"), 0
            for _ in range(args.rounds):
                started = time.perf_counter()
                size = len(encode_mp4(video, 16.0, preset=preset, threads=threads))
                best = min(best, time.perf_counter() - started)
            print(f"{kind:<8} {preset:<10} {threads.lower():<8} {best:>8.2f} {size // 1024:>8d}", flush=True)


if __name__ == "__main__":
    main()
