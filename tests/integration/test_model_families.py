"""The LLM-conditioned DiT families served end to end (`omni-triton serve
--demo qwen-image|z-image|flux2-klein|flux2-dev|flux1-dev`), and the parity matrix:
every route a user reaches a family by, with every form of negative prompt
under guidance (and without guidance, left out and a text), gives the image
of the family's own diffusers pipeline called the way its users call it (the
same prompt, negative prompt left out / "" / " " / a text, guidance, steps,
size and seed), within 1/255 per pixel (the server's CPU threads are not the
test's). The tiny pipelines are sensitive enough for that to mean something:
another prompt, negative prompt or guidance moves their images by tens of
levels (tests/unit/test_demo_sensitivity.py).

The routes: `diffusion` with the prompt as text; `diffusion` with
`ar_encoder`'s embeddings (the negative's left out when the negative prompt
is; FLUX.1's pooled CLIP vector beside them); the `text_to_image` ensemble; the `omni` scheduler; and the OpenAI
gateway's `/v1/images/generations` through the `openai` SDK."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from triton_omni_client import OmniClient, OmniError
from triton_omni_client.client import batched_inputs
from triton_omni_client.shared_memory import system_regions
from triton_omni_protocol import ADMIN_HEADER
from triton_omni_tools.gateway import Gateway
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

from tests.support.images import png
from tests.support.pipelines import ABSENT, NO_GUIDANCE, NO_NEGATIVE, call, encoded, levels_apart, pipeline, reference
from tests.support.server import metric_value, text_to_image

FAMILIES = ["qwen-image", "z-image", "flux2-klein", "flux2-dev", "flux1-dev"]
OPTIONS = {"num_inference_steps": 2, "height": 32, "width": 32, "seed": 7}
PROMPT = "a red fox"
NEGATIVES = {"absent": ABSENT, "empty": "", "blank": " ", "text": "blurry"}
GUIDED = 4.0


# The family whose server also loads `ar` (omni's prompt enhancement and hybrid routes, which are the
# scheduler's and the same for every family): the others' servers start without its engine.
WITH_AR = FAMILIES[0]


@pytest.fixture(scope="module", params=FAMILIES)
def family_server(request, tmp_path_factory):
    models = ["ar_encoder", "diffusion", "text_to_image", "omni"] + (["ar"] if request.param == WITH_AR else [])
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            model_control_mode="explicit", load_models=models,
                            demo=request.param, log_file=Path(tmp_path_factory.mktemp("logs") / "tritonserver.log"))
    with TritonServer(options) as server:
        gateway = Gateway(free_port(), "127.0.0.1", server.grpc_url, {}).start()
        try:
            server.openai = openai.OpenAI(base_url=f"http://{gateway.url}/v1", api_key="unused")
            yield request.param, server
        finally:
            gateway.stop()


def assert_close(image: np.ndarray, expected: np.ndarray) -> None:
    assert image.shape == expected.shape
    assert levels_apart(image, expected) <= 1


def served(route: str, server, negative, guidance: float) -> np.ndarray:
    """One image through ``route``, the negative prompt left out when ``ABSENT``."""
    given = {} if negative is ABSENT else {"negative_prompt": negative}
    options = OPTIONS | {"guidance_scale": guidance}
    client = OmniClient(server.grpc_url)
    if route == "diffusion":
        return client.generate_image(PROMPT, **given, **options)
    if route == "diffusion_embeds":
        conditioning = client.encode_conditioning(PROMPT, given.get("negative_prompt"))
        if not given:
            del conditioning["negative_prompt_embeds"]
        return client.generate_image(**conditioning, **options)
    if route == "text_to_image":
        return client.generate_image(PROMPT, model="text_to_image", **given, **options)
    if route == "omni":
        [image] = [event.image[0] for event in client.generate(PROMPT, modalities=["image"], **given, **options)
                   if event.image is not None]
        return image
    assert route == "openai"
    extensions = {**given, "guidance_scale": guidance, "seed": OPTIONS["seed"],
                  "num_inference_steps": OPTIONS["num_inference_steps"]}
    response = server.openai.images.generate(model="text_to_image", prompt=PROMPT, size="32x32",
                                             extra_body=extensions)
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))).convert("RGB"))


# Guided, every form of negative prompt; unguided, a negative is read by no family: left out and a text
NEGATIVE_CASES = [pytest.param(negative, True, id=f"{negative}-guided") for negative in NEGATIVES] + [
    pytest.param(negative, False, id=f"{negative}-unguided") for negative in ("absent", "text")]


@pytest.mark.parametrize(("negative", "guided"), NEGATIVE_CASES)
@pytest.mark.parametrize("route", ["diffusion", "diffusion_embeds", "text_to_image", "omni", "openai"])
def test_every_route_gives_the_pipelines_image_for_every_negative_prompt(family_server, route, negative, guided):
    family, server = family_server
    guidance = GUIDED if guided else NO_GUIDANCE[family]
    image = served(route, server, NEGATIVES[negative], guidance)
    assert_close(image, reference(family, PROMPT, NEGATIVES[negative], guidance_scale=guidance, **OPTIONS))


@pytest.mark.parametrize("negative", list(NEGATIVES))
def test_stable_diffusion_s_diffusion_routes_give_the_pipelines_image(server, negative):
    """The SD demo (the default server): `diffusion` with the prompt, and with the pipeline's own
    CLIP embeddings. (Its `text_to_image` conditions SD's UNet on the demo LLM's hidden states,
    which no diffusers pipeline does: there is no reference to hold it to.)"""
    negative = NEGATIVES[negative]
    client = OmniClient(server.grpc_url)
    given = {} if negative is ABSENT else {"negative_prompt": negative}
    for guidance in (NO_GUIDANCE["sd"], GUIDED):
        expected = reference("sd", PROMPT, negative, guidance_scale=guidance, **OPTIONS)
        assert_close(client.generate_image(PROMPT, **given, guidance_scale=guidance, **OPTIONS), expected)
        negative_embeds = None if negative is ABSENT else encoded("sd", negative)
        image = client.generate_image(prompt_embeds=encoded("sd", PROMPT), negative_prompt_embeds=negative_embeds,
                                      guidance_scale=guidance, **OPTIONS)
        assert_close(image, expected)


@pytest.mark.parametrize("negative", ["absent", "empty"])
def test_the_cli_sends_the_negative_prompt_as_given(family_server, negative, tmp_path):
    """`omni-triton generate-image --model text_to_image`, with `--negative-prompt` left out and ""."""
    family, server = family_server
    out = tmp_path / "image.png"
    given = [] if NEGATIVES[negative] is ABSENT else ["--negative-prompt", NEGATIVES[negative]]
    subprocess.run([str(Path(sys.executable).parent / "omni-triton"), "generate-image", PROMPT, "--model",
                    "text_to_image", *given, "--out", str(out), "--url", server.grpc_url, "--steps",
                    str(OPTIONS["num_inference_steps"]), "--seed", str(OPTIONS["seed"]), "--guidance", str(GUIDED),
                    "--height", "32", "--width", "32"], check=True)
    with Image.open(out) as written:
        image = np.asarray(written)
    assert_close(image, reference(family, PROMPT, NEGATIVES[negative], guidance_scale=GUIDED, **OPTIONS))


def test_the_readings_the_routes_gave_before_are_far_from_the_pipelines(family_server):
    """The matrix can fail: Z-Image's text_to_image read an absent negative prompt as the null
    condition (zero tokens), Qwen-Image's read "" as no negative (no true CFG); each of those
    images is far past the tolerance from the pipeline's (FLUX.2 [klein]'s too: it guides against "")."""
    family, server = family_server
    client = OmniClient(server.grpc_url)
    guided = OPTIONS | {"guidance_scale": GUIDED}
    if family in NO_NEGATIVE:  # guidance-distilled: a scale the DiT was not given reads as another image
        assert levels_apart(client.generate_image(PROMPT, **(guided | {"guidance_scale": 1.0})),
                            reference(family, PROMPT, **guided)) >= 10
    elif family != "qwen-image":
        embeds = client.encode(PROMPT)
        nulled = client.generate_image(prompt_embeds=embeds, negative_prompt_embeds=np.zeros((0, embeds.shape[1]),
                                       np.float32), **guided)
        assert levels_apart(nulled, reference(family, PROMPT, **guided)) >= 10
    else:
        unguided = client.generate_image(PROMPT, **guided)  # what "" was read as
        assert levels_apart(unguided, reference(family, PROMPT, "", **guided)) >= 10


# The first family's server, as every other test has it (the same parameter index: one server)
@pytest.mark.parametrize("family_server", [WITH_AR], indirect=True, scope="module")
def test_omni_s_other_routes_work_with_the_family(family_server):
    """Prompt enhancement (ar rewrites the prompt first) and the hybrid route end in an image too."""
    _, server = family_server
    client = OmniClient(server.grpc_url)

    def image_of(**kwargs) -> np.ndarray:
        images = [event.image for event in client.generate(PROMPT, **kwargs) if event.image is not None]
        assert len(images) == 1 and images[0].shape[0] == 1
        return images[0][0]

    assert image_of(modalities=["image"], enhance_prompt=True, max_tokens=8, **OPTIONS).shape == (32, 32, 3)
    assert image_of(modalities=["text", "image"], max_tokens=4, **OPTIONS).shape == (32, 32, 3)


def test_a_blank_negative_prompt_is_a_prompt_and_a_blank_prompt_an_error_naming_its_field(family_server):
    _, server = family_server
    client = OmniClient(server.grpc_url)
    for model, field in (("text_to_image", "text_input"), ("diffusion", "prompt")):
        with pytest.raises(OmniError, match=field) as caught:
            client.generate_image(" ", negative_prompt=" ", model=model, **OPTIONS)
        assert caught.value.status == "INVALID_ARG" and "negative_prompt" not in str(caught.value)
    with pytest.raises(openai.BadRequestError) as refused:
        server.openai.images.generate(model="text_to_image", prompt=" ", size="32x32")
    assert refused.value.body["param"] == "prompt"
    too_long = "x" * 20_000
    with pytest.raises(OmniError, match="negative_prompt") as caught:
        client.generate_image(PROMPT, negative_prompt=too_long, model="text_to_image", **OPTIONS)
    assert caught.value.status == "INVALID_ARG"


# The first family's server (the same parameter index: one server); the transport is every family's
@pytest.mark.parametrize("family_server", [WITH_AR], indirect=True, scope="module")
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_embeddings_through_shared_memory_give_the_same_image(family_server, protocol):
    """`OmniClient(shared_memory=True)`: the embeddings go through system shared memory regions (a
    client on the server's host), and the image comes back through one when its size is given;
    the image is the one sent in the request body, a bad tensor is refused by name as ever. The
    regions stay registered from one call to the next (one set per call in flight), are
    registered afresh when the server has forgotten them (as after a restart), and none is left
    registered after `close()`."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    _, server = family_server
    url = server.grpc_url if protocol == "grpc" else server.http_url
    admin = {f"triton-grpc-protocol-{ADMIN_HEADER}": server.admin_key}

    def registered() -> list:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            return client.get_system_shared_memory_status(headers=admin, as_json=True).get("regions", [])

    conditioning = OmniClient(server.grpc_url).encode_conditioning(PROMPT, "blurry")
    options = OPTIONS | {"guidance_scale": GUIDED}
    in_body = OmniClient(url, protocol).generate_image(**conditioning, **options)
    with OmniClient(url, protocol, shared_memory=True, admin_key=server.admin_key) as shared:
        assert np.array_equal(shared.generate_image(**conditioning, **options), in_body)
        kept = registered()
        assert len(kept) == 3  # the two embeddings' and the image's
        assert np.array_equal(shared.generate_image(**conditioning, **options), in_body)
        assert registered() == kept  # the same regions, not registered again
        unregister_all(server.grpc_url, admin)  # as a restarted server has none
        assert np.array_equal(shared.generate_image(**conditioning, **options), in_body)
        unsized = {key: value for key, value in options.items() if key not in ("height", "width")}
        assert np.array_equal(shared.generate_image(**conditioning, **unsized),  # the image in the response
                              OmniClient(url, protocol).generate_image(**conditioning, **unsized))
        with pytest.raises(OmniError, match="prompt_embeds") as caught:
            shared.generate_image(**(conditioning | {"prompt_embeds": conditioning["prompt_embeds"][:, :5]}),
                                  **options)
        assert caught.value.status == "INVALID_ARG"
    assert not registered()
    # the image through a region: the response carries none of it
    module = grpcclient if protocol == "grpc" else httpclient
    with module.InferenceServerClient(url) as client:
        output = module.InferRequestedOutput("image")
        inputs = batched_inputs(module, None, None, **conditioning, **options)
        with system_regions(client, [], shared._admin_headers, [(output, in_body.nbytes)]) as regions:
            result = client.infer("diffusion", inputs, outputs=[output])
            if protocol == "grpc":
                assert not any(result.get_response().raw_output_contents)
            else:  # neither JSON data nor a binary part
                assert not {"data", "parameters"} & set(result.get_output("image"))
            assert np.array_equal(regions.read(result, "image")[0], in_body)
    assert not registered()


def unregister_all(url: str, headers: dict[str, str]) -> None:
    """Every system shared memory region unregistered. Triton refuses while a region is in use, and
    it releases the last call's regions just after that call's response reaches the client: retried
    briefly, as the client's own unregistering is (shared_memory.py)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with grpcclient.InferenceServerClient(url) as client:
        for attempt in range(20):
            try:
                client.unregister_system_shared_memory(headers=headers)
                return
            except InferenceServerException:
                if attempt == 19:
                    raise
                time.sleep(0.05 * (attempt + 1))


# The families that read input images (FLUX.2's reference images); the others refuse them by name
TAKES_IMAGES = {"flux2-klein", "flux2-dev"}


def test_input_images_give_the_pipelines_image_or_are_refused_by_name(family_server, tmp_path):
    """`OmniClient.edit_image`, `generate-image --image` and OpenAI's `/v1/images/edits`: the
    pipeline's image with the same input images; bad images are INVALID_ARG (400) naming the field,
    and the server serves on; a family that reads no image says so."""
    family, server = family_server
    client = OmniClient(server.grpc_url)
    options = OPTIONS | {"guidance_scale": GUIDED}
    if family not in TAKES_IMAGES:
        with pytest.raises(OmniError, match="takes no input image") as caught:
            client.edit_image(PROMPT, [png(1)], **options)
        assert caught.value.status == "INVALID_ARG"
        with pytest.raises(openai.BadRequestError) as refused:
            server.openai.images.edit(model="diffusion", image=("a.png", png(1), "image/png"), prompt=PROMPT)
        assert refused.value.body["param"] == "image"
        return
    files = [png(1), png(2, 64, 96)]
    expected = call(pipeline(family), PROMPT, guidance_scale=GUIDED, seed=OPTIONS["seed"], height=32, width=32,
                    num_inference_steps=OPTIONS["num_inference_steps"],
                    image=[Image.open(io.BytesIO(data)) for data in files])[0].numpy()
    assert_close(client.edit_image(PROMPT, files, **options), expected)
    assert_close(client.edit_image(PROMPT, files, model="text_to_image", **options), expected)  # ar_encoder's text
    [by_omni] = [event.image[0] for event in client.generate(PROMPT, modalities=["image"], images=files, **options)
                 if event.image is not None]
    assert_close(by_omni, expected)
    paths = [tmp_path / "first.png", tmp_path / "second.png"]
    for path, data in zip(paths, files, strict=True):
        path.write_bytes(data)
    out = tmp_path / "edited.png"
    subprocess.run([str(Path(sys.executable).parent / "omni-triton"), "generate-image", PROMPT, "--image",
                    str(paths[0]), "--image", str(paths[1]), "--out", str(out), "--url", server.grpc_url, "--steps",
                    str(OPTIONS["num_inference_steps"]), "--seed", str(OPTIONS["seed"]), "--guidance", str(GUIDED),
                    "--height", "32", "--width", "32"], check=True)
    with Image.open(out) as written:
        assert_close(np.asarray(written), expected)
    for images, field in (([b"\x89PNG\r\n\x1a\n" + b"\x00" * 40], "images[0]"), ([png(1)] * 5, "images"),
                          ([png(1), b""], "images[1]"), ([png(1, 32, 32)], "images[0]")):
        with pytest.raises(OmniError, match=re.escape(field)) as caught:
            client.edit_image(PROMPT, images, **options)
        assert caught.value.status == "INVALID_ARG"
    assert client.edit_image(PROMPT, files, **options).shape == (32, 32, 3)  # served on
    openai_edits_give_the_pipelines_image(family, server, files)


def openai_edits_give_the_pipelines_image(family: str, server, files: list[bytes]) -> None:
    """`/v1/images/edits` through the `openai` SDK, sync and async, one image and several (`image[]`):
    the pipeline's image; a mask, a bad file and a model that reads no image are 400s naming the field."""
    extensions = {"seed": OPTIONS["seed"], "num_inference_steps": OPTIONS["num_inference_steps"],
                  "guidance_scale": GUIDED}

    def expected(count: int) -> np.ndarray:
        return call(pipeline(family), PROMPT, guidance_scale=GUIDED, seed=OPTIONS["seed"], height=32, width=32,
                    num_inference_steps=OPTIONS["num_inference_steps"],
                    image=[Image.open(io.BytesIO(data)) for data in files[:count]])[0].numpy()

    def pixels(response) -> np.ndarray:
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))).convert("RGB"))

    as_files = [(f"{i}.png", data, "image/png") for i, data in enumerate(files)]
    one = server.openai.images.edit(model="diffusion", image=as_files[0], prompt=PROMPT, size="32x32",
                                    extra_body=extensions)
    assert_close(pixels(one), expected(1))
    asynchronous = openai.AsyncOpenAI(base_url=str(server.openai.base_url), api_key="unused")

    async def edit_async():
        async with asynchronous:
            return await asynchronous.images.edit(model="diffusion", image=as_files, prompt=PROMPT, size="32x32",
                                                  n=2, extra_body=extensions)

    both = asyncio.run(edit_async())
    assert len(both.data) == 2
    assert_close(pixels(both), expected(2))
    for model in ("text_to_image", "omni"):
        response = server.openai.images.edit(model=model, image=as_files[0], prompt=PROMPT, size="32x32",
                                             extra_body=extensions)
        assert_close(pixels(response), expected(1))
    for kwargs, param in (({"mask": as_files[0]}, "mask"), ({"image": ("x.png", b"nope", "image/png")}, "image[0]"),
                          ({"model": "ar_encoder"}, "model")):
        with pytest.raises(openai.BadRequestError) as refused:
            server.openai.images.edit(**({"model": "diffusion", "image": as_files[0], "prompt": PROMPT} | kwargs))
        assert refused.value.body["param"] == param


def test_a_size_off_the_patch_grid_is_refused_by_name(family_server):
    _, server = family_server
    with pytest.raises(OmniError, match="height") as caught:
        OmniClient(server.grpc_url).generate_image(prompt="a red fox", **(OPTIONS | {"height": 34}))
    assert caught.value.status == "INVALID_ARG"


# thresholds at which the tiny DiTs skip some of 10 steps
STEP_CACHE = {"qwen-image": "first_block:0.4", "z-image": "first_block:0.8", "flux2-klein": "first_block:0.8",
              "flux2-dev": "first_block:0.8", "flux1-dev": "first_block:0.2"}


def test_a_request_chooses_its_step_cache_on_every_route(family_server):
    """`step_cache` reaches diffusion straight, through text_to_image's ensemble and through omni;
    the steps each request computed and skipped are counted per model."""
    family, server = family_server
    options = OPTIONS | {"num_inference_steps": 10}

    def steps(outcome: str) -> float:
        return metric_value(server, "omni_diffusion_cached_steps_total", model="diffusion", outcome=outcome)

    before = steps("computed"), steps("skipped")
    client = OmniClient(server.grpc_url)
    cached = client.generate_image(prompt="a red fox", negative_prompt="blurry", step_cache=STEP_CACHE[family],
                                   **options)
    plain = client.generate_image(prompt="a red fox", negative_prompt="blurry", step_cache="off", **options)
    computed, skipped = steps("computed") - before[0], steps("skipped") - before[1]
    assert computed + skipped == 10 and skipped > 0, (computed, skipped)
    assert metric_value(server, "omni_diffusion_skipped_step_ratio_count", model="diffusion") >= 1
    assert np.abs(cached.astype(int) - plain.astype(int)).max() > 0  # skipped steps change the image a little
    ensemble = text_to_image(server.grpc_url, "grpc", "a red fox", "blurry", step_cache=STEP_CACHE[family],
                             **options)
    assert steps("computed") + steps("skipped") - sum(before) == 20 and ensemble.shape == cached.shape
    [event] = [e for e in client.generate("a red fox", modalities=["image"], negative_prompt="blurry",
                                          step_cache=STEP_CACHE[family], **options) if e.image is not None]
    assert steps("computed") + steps("skipped") - sum(before) == 30 and event.image[0].shape == cached.shape


@pytest.mark.parametrize("value", ["teacache", "first_block:2", "first_block:x"])
def test_a_malformed_step_cache_is_invalid_arg_naming_it(family_server, value):
    _, server = family_server
    with pytest.raises(OmniError) as error:
        OmniClient(server.grpc_url).generate_image(prompt="a red fox", step_cache=value, **OPTIONS)
    assert error.value.status == "INVALID_ARG" and "step_cache" in str(error.value)
    assert OmniClient(server.grpc_url).generate_image(prompt="a red fox", **OPTIONS).shape == (32, 32, 3)
