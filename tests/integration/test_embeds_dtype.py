"""``embeds_dtype: bfloat16``: embeddings travel in bf16, half float32's bytes, and lose nothing
the DiT would keep (it runs in bf16 on a GPU). ``ar_encoder_bf16`` answers bf16 arrays
(``ml_dtypes.bfloat16``, as tritonclient reads BF16 tensors); the client sends them back as they
are, inline or through shared memory, and casts embeddings of another float type (float64, NumPy's
default, too) to the type the model declares; a raw tritonclient tensor of another type is still
refused by Triton (tests/reliability/test_bad_inputs.py). Every image equals the float32 model's
for the same (bf16) values."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from triton_omni_client import OmniClient, OmniError

OPTIONS = {"num_inference_steps": 2, "height": 32, "width": 32, "seed": 5, "guidance_scale": 7.5}
PROMPT = "a watercolor lighthouse"


@pytest.fixture(scope="module")
def conditioning(server) -> dict[str, np.ndarray]:
    client = OmniClient(server.grpc_url)
    return {"bf16": client.encode_conditioning(PROMPT, "blurry", model="ar_encoder_bf16"),
            "fp32": client.encode_conditioning(PROMPT, "blurry", model="ar_encoder_transformers")}


def test_a_bf16_encoder_answers_its_float32_encoding_rounded_to_bf16(conditioning):
    for name, embeds in conditioning["bf16"].items():
        assert embeds.dtype == ml_dtypes.bfloat16, name
        assert np.array_equal(embeds, conditioning["fp32"][name].astype(ml_dtypes.bfloat16)), name


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bf16_embeddings_give_the_float32_models_image(server, conditioning, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    bf16 = conditioning["bf16"]
    as_float32 = {name: embeds.astype(np.float32) for name, embeds in bf16.items()}
    expected = OmniClient(url, protocol).generate_image(**as_float32, **OPTIONS)  # `diffusion`: float32
    as_float64 = {name: embeds.astype(np.float64) for name, embeds in bf16.items()}  # NumPy's default, cast
    assert np.array_equal(OmniClient(url, protocol).generate_image(**as_float64, **OPTIONS), expected)
    clients = {"inline": OmniClient(url, protocol),
               "shared memory": OmniClient(url, protocol, shared_memory=True, admin_key=server.admin_key)}
    for how, client in clients.items():
        for given, embeds in {"bf16": bf16, "float32, cast by the client": as_float32}.items():
            image = client.generate_image(**embeds, model="diffusion_bf16", **OPTIONS)
            assert np.array_equal(image, expected), (how, given)
    other = OmniClient(url, protocol).generate_image(**(as_float32 | {"prompt_embeds": as_float32["prompt_embeds"]
                                                                      * -1}), **OPTIONS)
    assert np.abs(other.astype(int) - expected).max() > 10  # the comparison can fail


def test_a_bad_bf16_tensor_is_refused_by_name(server, conditioning):
    client = OmniClient(server.grpc_url)
    embeds = conditioning["bf16"]["prompt_embeds"]
    with pytest.raises(OmniError, match="prompt_embeds") as caught:
        client.generate_image(prompt_embeds=embeds[:, :5], model="diffusion_bf16", **OPTIONS)
    assert caught.value.status == "INVALID_ARG"
