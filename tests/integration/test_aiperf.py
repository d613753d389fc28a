"""AIPerf 0.13 (NVIDIA's successor to genai-perf, OpenAI's API only) drives the
gateway as its users run it: `chat` streaming and `image_generation`, with no
errors. A smoke run: the figures themselves are the benchmark's business."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from triton_omni_tools.gateway import text_model_tokenizers

AIPERF = Path(sys.prefix + "-aiperf") / "bin" / "aiperf"  # scripts/install_perf.sh --aiperf


def aiperf(gateway: str, tokenizer: str, out: Path, *args: str) -> dict:
    command = [str(AIPERF), "profile", "--url", gateway, "--tokenizer", tokenizer, "--artifact-dir", str(out),
               "--ui-type", "none", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "profile_export_aiperf.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(server) -> str:
    assert AIPERF.exists(), f"{AIPERF} missing: make install (scripts/install_perf.sh .venv --aiperf) installs it"
    return text_model_tokenizers(server.repositories)["ar"]


def test_aiperf_streams_chat_with_no_errors(gateway, tokenizer, tmp_path):
    report = aiperf(gateway, tokenizer, tmp_path, "--model", "ar", "--endpoint-type", "chat", "--streaming",
                    "--request-count", "12", "--concurrency", "4", "--synthetic-input-tokens-mean", "16",
                    "--output-tokens-mean", "8", "--extra-inputs", "ignore_eos:true")
    assert report["request_count"]["avg"] == 12 and report["error_summary"] == []
    assert report["output_token_throughput"]["avg"] > 0 and report["time_to_first_token"]["count"] == 12


def test_aiperf_generates_images_with_no_errors(gateway, tokenizer, tmp_path):
    report = aiperf(gateway, tokenizer, tmp_path, "--model", "text_to_image", "--endpoint-type", "image_generation",
                    "--request-count", "6", "--concurrency", "3", "--synthetic-input-tokens-mean", "8",
                    "--extra-inputs", "size:32x32", "num_inference_steps:2")
    assert report["request_count"]["avg"] == 6 and report["error_summary"] == []
