"""The OpenAI gateway's pieces without a server: request bodies checked and
turned into the models' inputs, Triton's errors mapped onto OpenAI's, log
probabilities reshaped."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
from PIL import Image
from triton_omni_client import OmniError
from triton_omni_client.video import decode_mp4, encode_mp4
from triton_omni_gateway.__main__ import main
from triton_omni_gateway.app import GatewaySettings
from triton_omni_gateway.errors import OpenAIError, from_triton
from triton_omni_gateway.images import _options, _seeded, png
from triton_omni_gateway.requests import ChatRequest, CompletionRequest, ImageRequest, parse
from triton_omni_gateway.text import Delta, ar_values, chat_logprobs, completion_logprobs, joined


def refused(kind, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as error:
        parse(kind, json.dumps(body).encode() if not isinstance(body, bytes) else body)
    assert error.value.status == 400
    return error.value


def test_chat_sampling_uses_vllm_s_names():
    request = parse(ChatRequest, json.dumps({
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 7, "temperature": 0.5, "stop": "x", "seed": 3, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 2}).encode())
    assert request.sampling() == {"n": 1, "temperature": 0.5, "seed": 3, "ignore_eos": True, "stop": ["x"],
                                  "max_tokens": 7, "logprobs": 2}
    assert request.chat() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    values = ar_values("prompt", request.sampling())
    assert values["stream"] and values["exclude_input_in_output"] and values["return_logprobs"]
    assert json.loads(values["sampling_parameters"])["max_tokens"] == 7


def test_errors_name_the_field_without_pydantic_s_union_members():
    assert refused(ChatRequest, {"messages": [{"role": "user", "content": 5}]}).param == "messages.0.content"
    assert refused(CompletionRequest, {"prompt": "a", "stop": 5}).param == "stop"
    assert refused(CompletionRequest, {"prompt": "a", "bogus": 1}).message == "bogus: unknown field (not part of " \
        "this API)"
    assert refused(ImageRequest, {"prompt": "a", "style": "vivid"}).param == "style"
    assert refused(ImageRequest, b"\xff").code == "invalid_json"


@pytest.mark.parametrize(("part", "param", "says"), [
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "ogg"}},
     "messages.0.content.1.input_audio.format", "Input should be 'wav' or 'mp3'"),
    ({"type": "file", "file": {"file_id": "f"}}, "messages.0.content.1.type", "'file' parts are not read"),
    ({"type": "text"}, "messages.0.content.1.text", "Field required"),
    ({"type": "video"}, "messages.0.content.1.type", "Input should be 'text'"),
])
def test_a_content_part_the_models_do_not_read_is_refused_by_its_own_name(part, param, says):
    """Not "the content should have been a string": the part at fault, and why."""
    error = refused(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]})
    assert error.param == param and says in error.message


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def test_input_audio_parts_reach_the_template_and_the_model_in_order():
    request = parse(ChatRequest, json.dumps({"messages": [
        {"role": "system", "content": "Listen."},
        {"role": "user", "content": [audio_part(b"first"), {"type": "text", "text": "and "},
                                     audio_part(b"second", "mp3")]}]}).encode())
    assert request.chat() == [{"role": "system", "content": "Listen."},
                              {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "and "},
                                                           {"type": "audio"}]}]
    assert request.audio_clips() == [b"first", b"second"]
    assert request.audio_parts() == ["messages.1.content.0", "messages.1.content.2"]
    assert [request.part_of(p) for p in ("input_audio[1]", "input_audio", "input_audio[7]", "max_tokens",
                                               None)] == ["messages.1.content.2", "messages.1.content.0",
                                                          "messages.1.content.0", None, None]
    assert ar_values("p", {}, audio=request.audio_clips())["input_audio"] == [b"first", b"second"]
    assert "input_audio" not in ar_values("p", {})


def image_part(data: bytes, kind: str = "png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/{kind};base64,{base64.b64encode(data).decode()}"}}


def test_image_url_parts_reach_the_template_and_the_model_in_order():
    request = parse(ChatRequest, json.dumps({"messages": [
        {"role": "user", "content": [image_part(b"first"), audio_part(b"clip"), {"type": "text", "text": "and "},
                                     image_part(b"second", "jpeg")]}]}).encode())
    assert request.chat() == [{"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                                           {"type": "text", "text": "and "}, {"type": "image"}]}]
    assert request.image_files() == [b"first", b"second"] and request.audio_clips() == [b"clip"]
    assert [request.part_of(p) for p in ("images[1]", "images", "input_audio[0]")] == [
        "messages.0.content.3", "messages.0.content.0", "messages.0.content.1"]
    assert ar_values("p", {}, images=request.image_files())["images"] == [b"first", b"second"]
    assert "images" not in ar_values("p", {})


@pytest.mark.parametrize(("part", "param", "says"), [
    ({"type": "image_url", "image_url": {"url": "https://example.com/fox.png"}}, "messages.0.content.0.image_url.url",
     "this gateway fetches nothing"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "messages.0.content.0.image_url.url",
     "must be base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "messages.0.content.0.image_url.url",
     "is not base64"),
])
def test_an_image_url_the_gateway_cannot_pass_on_is_refused_naming_it(part, param, says):
    with pytest.raises(OpenAIError) as error:
        parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": [part]}]}).encode()).image_files()
    assert error.value.param == param and says in error.value.message
    assistant = {"messages": [{"role": "assistant", "content": [image_part(b"x")]}]}
    assert refused(ChatRequest, assistant).param == "messages.0.content.0.type"


@pytest.mark.parametrize(("messages", "extra", "param"), [
    ([{"role": "assistant", "content": [audio_part(b"x")]}], {}, "messages.0.content.0.type"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}]}], {},
     "messages.0.content.0.input_audio.data"),
])
def test_input_audio_the_gateway_cannot_pass_on_is_refused_naming_the_part(messages, extra, param):
    with pytest.raises(OpenAIError) as error:
        request = parse(ChatRequest, json.dumps({"messages": messages} | extra).encode())
        request.audio_clips()
        assert request.speaks
    assert error.value.param == param


def test_image_size_seeds_and_guidance():
    request = parse(ImageRequest, b'{"prompt": "a", "size": "64x32", "seed": 5, "true_cfg_scale": 4}')
    options = _options(request)
    assert options == {"width": 64, "height": 32, "seed": 5, "guidance_scale": 4.0}
    assert [_seeded(options, i)["seed"] for i in range(3)] == [5, 6, 7]
    assert _options(parse(ImageRequest, b'{"prompt": "a", "size": "auto"}')) == {}
    for size in ("64", "64x", "x64", "0x64", "64x5000", "axb"):
        with pytest.raises(OpenAIError) as error:
            _options(parse(ImageRequest, json.dumps({"prompt": "a", "size": size}).encode()))
        assert error.value.param == "size"


def test_triton_errors_become_openai_errors():
    refusal = from_triton(OmniError("INVALID_ARG", "invalid `temperature`: must be in [0.0, 100.0], got -1"), "ar")
    assert (refusal.status, refusal.param) == (400, "temperature")
    missing = from_triton(OmniError("UNKNOWN", "Request for unknown model: 'x' is not found"), "x")
    assert (missing.status, missing.param) == (404, "model")
    assert from_triton(OmniError("UNAVAILABLE", "connect failed"), "ar").status == 503
    assert from_triton(OmniError("INTERNAL", "boom"), "ar").body()["error"]["type"] == "server_error"


POSITIONS = [  # the model's shape: the sampled token first, then the top candidates
    {"7": {"logprob": -2.0, "rank": 3, "decoded_token": "c"}, "1": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
     "2": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}},
    {"1": {"logprob": -0.1, "rank": 1, "decoded_token": "de"}},
]


def test_log_probabilities_in_openai_s_shapes():
    chat = chat_logprobs(POSITIONS, top=2)
    assert [entry["token"] for entry in chat] == ["c", "de"]
    assert [t["token"] for t in chat[0]["top_logprobs"]] == ["a", "b"]
    assert chat[1]["bytes"] == list(b"de")
    legacy = completion_logprobs(POSITIONS, top=1, offset=4)
    assert legacy == {"tokens": ["c", "de"], "token_logprobs": [-2.0, -0.1],
                      "top_logprobs": [{"a": -0.5}, {"de": -0.1}], "text_offset": [4, 5]}


def test_outputs_read_from_the_raw_bytes_as_as_numpy_would():
    import struct

    import numpy as np
    import tritonclient.grpc as grpcclient
    from triton_omni_gateway.triton import outputs
    from tritonclient.grpc import service_pb2

    response = service_pb2.ModelInferResponse()
    for name, datatype, raw in (
            ("text_output", "BYTES", b"".join(struct.pack("<I", len(t)) + t for t in (b" fox", b"", "é".encode()))),
            ("num_output_tokens", "UINT32", np.array([2, 0, 1], np.uint32).tobytes()),
            ("cumulative_logprob", "FP32", np.array([-1.5, 0, -2], np.float32).tobytes())):
        output = response.outputs.add()
        output.name, output.datatype = name, datatype
        output.shape.append(3)
        response.raw_output_contents.append(raw)
    result = grpcclient.InferResult(response)
    found = outputs(result)
    assert found == {"text_output": [" fox", "", "é"], "num_output_tokens": [2, 0, 1],
                     "cumulative_logprob": [-1.5, 0.0, -2.0]}
    assert [v.decode() for v in result.as_numpy("text_output")] == found["text_output"]


def edit_form(*items):
    import io

    from starlette.datastructures import FormData, UploadFile

    image = UploadFile(io.BytesIO(b"\x89PNG..."), filename="a.png")
    return FormData([("image", image), ("prompt", "a red fox"), *items])


@pytest.mark.parametrize(("items", "param", "words"), [
    ((("mask", "x"),), "mask", "inpainting is not served"),
    ((("n", "two"),), "n", "must be a number"),
    ((("n", "2"), ("n", "3")), "n", "more than once"),
    ((("enhance_prompt", "maybe"),), "enhance_prompt", "true or false"),
    ((("style", "vivid"),), "style", "no style setting"),
    ((("colour", "red"),), "colour", "unknown field"),
    ((("n", "11"),), "n", "less than or equal to 10"),
])
def test_an_edit_form_is_refused_naming_its_field(items, param, words):
    import asyncio

    from triton_omni_gateway.requests import parse_edit

    with pytest.raises(OpenAIError) as error:
        asyncio.run(parse_edit(edit_form(*items)))
    assert error.value.status == 400 and error.value.param == param and words in error.value.message


def test_an_edit_form_reads_its_numbers_and_files():
    import asyncio
    import io

    from starlette.datastructures import FormData, UploadFile
    from triton_omni_gateway.requests import parse_edit

    request = asyncio.run(parse_edit(edit_form(("n", "2"), ("seed", "7"), ("guidance_scale", "3.5"),
                                               ("enhance_prompt", "true"))))
    assert (request.n, request.seed, request.guidance_scale, request.model) == (2, 7, 3.5, "diffusion")
    assert request.images == [b"\x89PNG..."] and _options(request) == {"seed": 7, "guidance_scale": 3.5}
    several = FormData([("image[]", UploadFile(io.BytesIO(data), filename="x.png")) for data in (b"a", b"b")]
                       + [("prompt", "x")])
    assert asyncio.run(parse_edit(several)).images == [b"a", b"b"]
    with pytest.raises(OpenAIError, match="image: is required"):
        asyncio.run(parse_edit(FormData([("prompt", "x")])))


@pytest.mark.parametrize("level", [0, 1, 9])
def test_the_images_png_is_lossless_at_every_deflate_level(level):
    pixels = np.random.default_rng(level).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(png(pixels, level)))))
    assert np.array_equal(decoded, pixels)


def test_a_png_level_outside_zlibs_is_refused_by_name():
    with pytest.raises(ValueError, match="png_compress_level must be 0 to 9, got 10"):
        GatewaySettings(png_compress_level=10)
    with pytest.raises(SystemExit):
        main(["--png-compress-level", "10"])


def test_an_x264_preset_that_is_not_one_is_refused_by_name():
    with pytest.raises(ValueError, match=r"video_preset must be one of x264's: ultrafast, .*; got 'quick'"):
        GatewaySettings(video_preset="quick")
    with pytest.raises(SystemExit):
        main(["--video-preset", "quick"])
    with pytest.raises(ValueError, match="preset must be one of x264's"):
        encode_mp4(np.zeros((1, 16, 16, 3), np.uint8), 16.0, preset="quick")


@pytest.mark.parametrize("preset", ["ultrafast", "veryfast", "medium"])
def test_every_preset_encodes_the_same_frames_near_alike(preset):
    """The preset trades the encoder's search for bytes, not the frames: each decodes near its source."""
    y, x = np.mgrid[0:32, 0:48]
    frames = np.stack([np.stack([(x * 5 + t * 8) % 256, (y * 7) % 256, ((x + y) * 3) % 256], -1)
                       for t in range(5)]).astype(np.uint8)
    decoded, fps = decode_mp4(encode_mp4(frames, 16.0, preset=preset))
    assert fps == 16.0 and decoded.shape == frames.shape
    assert np.abs(decoded.astype(float) - frames).mean() < 4.0


# -- several completion prompts joined into one stream of their choices

async def _prompt(index: int, deltas: int, closed: list[int], refuse: bool = False):
    """Prompt ``index``'s stream of two completions: ``deltas`` deltas, the last finishing both."""
    try:
        for step in range(deltas):
            await asyncio.sleep(0.001 * (3 - index))  # the last prompt answers first
            if refuse:
                raise OpenAIError(400, "text_input: too long", param="text_input")
            yield Delta(texts=[f"{index}.{step}a", f"{index}.{step}b"], tokens=[1, 1], logprobs=[None, None],
                        finish_reasons=["length", "stop"] if step == deltas - 1 else None, prompt_tokens=10 + index)
    finally:
        closed.append(index)


def test_joined_prompts_keep_each_prompt_s_choices_in_its_place():
    async def run():
        closed: list[int] = []
        return [d async for d in joined([_prompt(i, 3 - i, closed) for i in range(3)], 2)], closed

    deltas, closed = asyncio.run(run())
    texts = ["".join(d.texts[i] for d in deltas) for i in range(6)]
    assert texts == ["0.0a0.1a0.2a", "0.0b0.1b0.2b", "1.0a1.1a", "1.0b1.1b", "2.0a", "2.0b"]
    # every prompt's first response before anything passes on: the first three deltas are the three prompts'
    assert [next(i for i, t in enumerate(d.texts) if t) // 2 for d in deltas[:3]] == [2, 1, 0]
    reasons = [r for d in deltas if d.finish_reasons for r in d.finish_reasons if r is not None]
    assert sorted(reasons) == ["length"] * 3 + ["stop"] * 3
    assert {d.prompt_tokens for d in deltas} == {33} and sorted(closed) == [0, 1, 2]


def test_a_refused_prompt_refuses_the_joined_stream_and_closes_the_others():
    async def run():
        closed: list[int] = []
        # prompt 1 answers before prompt 0 refuses: nothing may pass on before the refusal
        stream = joined([_prompt(0, 1, closed, refuse=True), _prompt(1, 50, closed)], 2)
        with pytest.raises(OpenAIError, match="too long"):
            await anext(stream)
        return closed

    assert sorted(asyncio.run(run())) == [0, 1]
