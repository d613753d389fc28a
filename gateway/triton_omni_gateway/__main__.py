"""``python -m triton_omni_gateway``: the OpenAI-compatible API over a running Triton.

``omni-triton serve`` starts it (``--openai-port``); run by hand, it fronts
any Triton that serves these models."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import tempfile

import uvicorn
from triton_omni_client.video import PRESET, PRESETS

from triton_omni_gateway.app import API_KEY_ENV, SETTINGS_ENV, GatewaySettings, create_app

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's: where each worker writes its values
METRICS_DIR_PREFIX = "triton-omni-gateway-metrics-"


def tokenizer_pair(text: str) -> tuple[str, str]:
    model, equals, path = text.partition("=")
    if not (equals and model and path):
        raise argparse.ArgumentTypeError(f"expected MODEL=PATH, got {text!r}")
    return model, path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m triton_omni_gateway", description=__doc__)
    parser.add_argument("--triton-url", default="localhost:8001", help="Triton's gRPC endpoint")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    parser.add_argument("--workers", type=int, default=1, help="processes answering requests: one process's "
                        "event loop bounds the tokens a second it can stream; more spread the work over cores")
    parser.add_argument("--tokenizer", type=tokenizer_pair, action="append", default=[], metavar="MODEL=PATH",
                        help="the tokenizer whose chat template /v1/chat/completions uses for MODEL")
    parser.add_argument("--png-compress-level", type=int, choices=range(10), default=1, metavar="0-9",
                        help="the images' PNG deflate level: a client waits for the encoding; 1 (default) encodes "
                        "photographs about twice as fast as 6 for some 15%% more bytes, 9 makes the smallest files")
    parser.add_argument("--max-video-jobs", type=int, default=32, metavar="N",
                        help="/v1/videos: jobs held at once, running and finished (a finished video is kept until "
                        "deleted or --video-keep-s after it ends)")
    parser.add_argument("--video-keep-s", type=float, default=3600.0, metavar="S")
    parser.add_argument("--video-preset", choices=PRESETS, default=PRESET,
                        help=f"/v1/videos: x264's speed preset for the MP4s (default {PRESET}: a client waits for the "
                        "encode; slower presets make smaller files of the same quality)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    settings = GatewaySettings(triton_url=args.triton_url, api_key=args.api_key, tokenizers=dict(args.tokenizer),
                               png_compress_level=args.png_compress_level, workers=max(1, args.workers),
                               max_video_jobs=args.max_video_jobs, video_keep_s=args.video_keep_s,
                               video_preset=args.video_preset)
    server = {"host": args.host, "port": args.port, "log_level": "warning", "access_log": False}
    if args.workers <= 1:
        uvicorn.run(create_app(settings), **server)
        return
    # Each worker is a fresh interpreter: settings and the metrics' shared folder go through the environment.
    # The folder is the launcher's when it gives one (it removes it however this process ends), else ours.
    with contextlib.ExitStack() as stack:
        if not os.environ.get(METRICS_DIR_ENV):
            os.environ[METRICS_DIR_ENV] = stack.enter_context(tempfile.TemporaryDirectory(prefix=METRICS_DIR_PREFIX))
        os.environ[SETTINGS_ENV] = json.dumps(dataclasses.asdict(settings))
        uvicorn.run("triton_omni_gateway.app:app_from_environment", factory=True, workers=args.workers, **server)


if __name__ == "__main__":
    main()
