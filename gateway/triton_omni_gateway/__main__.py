"""``python -m triton_omni_gateway``: the OpenAI-compatible API over a running Triton.

``omni-triton serve`` starts it (``--openai-port``); run by hand, it fronts
any Triton that serves these models."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from triton_omni_gateway.app import API_KEY_ENV, GatewaySettings, create_app


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
    parser.add_argument("--tokenizer", type=tokenizer_pair, action="append", default=[], metavar="MODEL=PATH",
                        help="the tokenizer whose chat template /v1/chat/completions uses for MODEL")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    settings = GatewaySettings(triton_url=args.triton_url, api_key=args.api_key, tokenizers=dict(args.tokenizer))
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
