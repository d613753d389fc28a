"""LoRA adapters per request on a real server: a Z-Image `diffusion` model whose `lora_adapters`
name two tiny adapters, one slot on the device (`max_loras` 1, so they take turns). Concurrent
gRPC requests with either adapter, another scale or none each get the pipeline's image with
that adapter (`load_lora_weights`, `set_adapters`), as do the `openai` SDK's generations with the
extension fields and `omni-triton generate-image --lora`. An unknown adapter is a 400 naming
`lora` and the server serves on; /metrics counts requests, loads and evictions per adapter.
The SD demo's models (no adapters) refuse `lora` on every route (test_diffusion.py)."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from triton_omni_client import OmniClient, OmniError
from triton_omni_tools.launcher import PROJECT_ROOT, ServerOptions, free_port
from triton_omni_tools.repository import copy_model

from tests.support.loras import build_lora, with_adapter
from tests.support.pipelines import GUIDANCE_KEYWORD, call, levels_apart
from tests.support.server import metric_value, serving_openai

FAMILY = "z-image"
PROMPT = "a red fox"
OPTIONS = {"num_inference_steps": 2, "height": 32, "width": 32, "seed": 7, "guidance_scale": 4.0,
           "negative_prompt": "blurry"}


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {"fox": build_lora(FAMILY, root / "fox", seed=1), "ink": build_lora(FAMILY, root / "ink", seed=2, rank=8)}


@pytest.fixture(scope="module")
def lora_server(loras, tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    copy_model(PROJECT_ROOT / "model_repository", "diffusion", repository, parameters={
        "model": "demo:tiny-z-image", "max_loras": "1",
        "lora_adapters": json.dumps({name: str(folder) for name, folder in loras.items()})})
    options = ServerOptions(model_repositories=[repository], http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(),
                            log_file=Path(tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    with serving_openai(options) as server:
        yield server


def expected(folder: Path | None, scale: float = 1.0) -> np.ndarray:
    options = {k: v for k, v in OPTIONS.items() if k not in ("seed", "negative_prompt", "guidance_scale")}
    with with_adapter(FAMILY, folder, scale) as pipe:
        return call(pipe, PROMPT, OPTIONS["negative_prompt"], guidance_keyword=GUIDANCE_KEYWORD[FAMILY],
                    guidance_scale=OPTIONS["guidance_scale"], seed=OPTIONS["seed"], **options)[0].numpy()


def test_concurrent_requests_with_different_adapters_get_the_pipelines_images(lora_server, loras):
    client = OmniClient(lora_server.grpc_url)
    asks = [{"lora": "fox"}, {}, {"lora": "ink", "lora_scale": 0.5}, {"lora": "fox", "lora_scale": 1.5}]
    with ThreadPoolExecutor(len(asks)) as pool:
        served = list(pool.map(lambda ask: client.generate_image(PROMPT, **OPTIONS, **ask), asks))
    for ask, image in zip(asks, served, strict=True):
        folder = loras.get(ask.get("lora"))
        assert levels_apart(image, expected(folder, ask.get("lora_scale", 1.0))) <= 1, ask
    assert levels_apart(served[0], served[1]) > 10  # the adapter shows


def test_the_openai_sdk_and_the_cli_take_an_adapter(lora_server, loras, tmp_path):
    reference = expected(loras["ink"], 0.8)
    result = lora_server.openai.images.generate(
        model="diffusion", prompt=PROMPT, size="32x32",
        extra_body={"lora": "ink", "lora_scale": 0.8, "seed": 7, "num_inference_steps": 2, "guidance_scale": 4.0,
                    "negative_prompt": "blurry"})
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"))
    assert levels_apart(image, reference) <= 1
    out = tmp_path / "out.png"
    subprocess.run([str(Path(sys.executable).parent / "omni-triton"), "generate-image", PROMPT, "--lora", "ink:0.8",
                    "--negative-prompt", "blurry", "--out", str(out), "--url", lora_server.grpc_url, "--steps", "2",
                    "--seed", "7", "--guidance", "4", "--height", "32", "--width", "32"], check=True)
    assert levels_apart(np.asarray(Image.open(out).convert("RGB")), reference) <= 1


def test_an_unknown_adapter_is_refused_by_name_and_metrics_count_per_adapter(lora_server):
    client = OmniClient(lora_server.http_url, protocol="http")
    with pytest.raises(OmniError) as refused:
        client.generate_image(PROMPT, lora="nope", **OPTIONS)
    assert refused.value.status == "INVALID_ARG" and "lora" in str(refused.value) and "nope" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as bad:
        lora_server.openai.images.generate(model="diffusion", prompt=PROMPT, extra_body={"lora": "nope"})
    assert bad.value.body["param"] == "lora"
    client.generate_image(PROMPT, lora="fox", **OPTIONS)  # still serving
    client.generate_image(PROMPT, lora="ink", **OPTIONS)  # one slot: fox goes
    count = lambda name, adapter: metric_value(lora_server, name, model="diffusion", adapter=adapter)  # noqa: E731
    assert count("omni_diffusion_lora_requests_total", "fox") >= 1
    assert count("omni_diffusion_lora_requests_total", "ink") >= 1
    assert count("omni_diffusion_lora_loads_total", "ink") >= 1
    assert count("omni_diffusion_lora_evictions_total", "fox") >= 1
