"""The two pipelines on a real server: the `text_to_image` ensemble and the `omni` BLS scheduler."""

from __future__ import annotations

import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image
from triton_omni_client import OmniClient, OmniError
from triton_omni_client.client import omni_inputs

from tests.support.server import metric_value, text_to_image

STEPS = 3


def by_hand(url: str, prompt: str, negative: str | None = None, **options) -> np.ndarray:
    """ar_encoder (the prompt and its negative side), then diffusion: what the pipelines must
    reproduce exactly."""
    client = OmniClient(url, "http")
    embeds, negative_embeds = client.encode_with_negative(prompt, negative)
    return client.generate_image(prompt_embeds=embeds, negative_prompt_embeds=negative_embeds, **options)


# -- text_to_image ensemble -------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("negative", [None, "", "blurry, low quality"])
def test_ensemble_equals_the_stages_called_by_hand(server, protocol, negative):
    options = {"seed": 11, "num_inference_steps": STEPS, "guidance_scale": 5.0}
    url = server.http_url if protocol == "http" else server.grpc_url
    image = text_to_image(url, protocol, "a lighthouse at dusk", negative, **options)
    assert image.shape == (64, 64, 3) and image.dtype == np.uint8
    np.testing.assert_array_equal(image, by_hand(server.http_url, "a lighthouse at dusk", negative, **options))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_client_and_the_cli_generate_through_the_ensemble(server, protocol, tmp_path):
    """``generate_image(model="text_to_image")`` and ``generate-image --model text_to_image``: the
    ensemble's text input is ``text_input``, which the client finds in the model's metadata."""
    options = {"seed": 11, "num_inference_steps": STEPS, "guidance_scale": 5.0}
    url = server.http_url if protocol == "http" else server.grpc_url
    expected = text_to_image(url, protocol, "a lighthouse at dusk", "blurry", **options)
    client = OmniClient(url, protocol)
    image = client.generate_image("a lighthouse at dusk", negative_prompt="blurry", model="text_to_image", **options)
    np.testing.assert_array_equal(image, expected)
    out = tmp_path / "lighthouse.png"
    subprocess.run([str(Path(sys.executable).parent / "omni-triton"), "generate-image", "a lighthouse at dusk",
                    "--model", "text_to_image", "--negative-prompt", "blurry", "--out", str(out), "--url", url,
                    "--protocol", protocol, "--steps", str(STEPS), "--seed", "11", "--guidance", "5"],
                   check=True)
    with Image.open(out) as written:
        np.testing.assert_array_equal(np.asarray(written), expected)


def test_ensemble_reports_the_diffusion_stage_error(http_url):
    with pytest.raises(Exception) as info:
        text_to_image(http_url, "http", "a fox", height=500)
    assert "400" in str(info.value) and "height" in str(info.value)


def test_a_too_long_prompt_is_refused_naming_the_user_s_input(http_url):
    """`ar_encoder` stops at the diffusion model's token limit (max_prompt_tokens), so the
    ensemble's error names `text_input`, not the internal `prompt_embeds`."""
    long_prompt = " ".join(f"w{i}" for i in range(700))
    with pytest.raises(Exception) as info:
        text_to_image(http_url, "http", long_prompt, num_inference_steps=2)
    message = str(info.value)
    assert "400" in message and "text_input" in message and "at most 512" in message, message
    assert "prompt_embeds" not in message


# -- omni scheduler: the four routes ------------------------------------------------------------


# A stream that stalls fails its test rather than holding the suite (no response for this long).
STALL_S = 120


def events(url, prompt, **kwargs):
    return list(OmniClient(url).generate(prompt, timeout_s=STALL_S, **kwargs))


def test_text_route_streams_deltas(grpc_url):
    # (32 tokens: on a busy host a stream's quick tokens merge into fewer responses, by design)
    stream = events(grpc_url, "once upon a time", modalities=["text"], max_tokens=32, seed=1,
                    parameters={"ignore_eos": "true"})
    assert len(stream) >= 2
    assert all(e.image is None and e.stage is None for e in stream)
    assert stream[-1].finish_reason == "length"
    text = "".join(e.text for e in stream)
    assert text == "".join(c.text for c in OmniClient(grpc_url).generate_text(
        "once upon a time", stream=True, max_tokens=32, seed=1, sampling_parameters={"ignore_eos": True}))


def test_text_route_takes_the_same_sampling_contract_as_ar(grpc_url):
    """omni's `parameters` JSON: any vLLM sampling key, numbers as strings."""
    options = {"max_tokens": "6", "temperature": "0", "presence_penalty": "0.5", "ignore_eos": "true"}
    stream = events(grpc_url, "once upon a time", modalities=["text"], parameters=options)
    assert stream[-1].finish_reason == "length"
    expected = OmniClient(grpc_url).generate_text("once upon a time", stream=True, sampling_parameters=options)
    assert "".join(e.text for e in stream) == "".join(c.text for c in expected)


def test_the_cli_passes_any_sampling_key_with_param(server, capsys):
    from triton_omni_tools.cli import main

    code = main(["generate-text", "once upon a time", "--url", server.grpc_url, "--param", "max_tokens=3",
                 "--param", "temperature=0", "--param", "presence_penalty=0.5"])
    assert code == 0
    code = main(["generate-text", "once upon a time", "--url", server.grpc_url, "--param", "max_token=3"])
    assert code == 1
    assert "INVALID_ARG" in capsys.readouterr().err
    code = main(["generate", "once upon a time", "--url", server.grpc_url, "--param", "max_tokens=\"3\"",
                 "--param", "top_k=20"])
    assert code == 0


def test_image_route_streams_progress_in_order_then_the_image(server):
    options = {"seed": 5, "num_inference_steps": STEPS}
    stream = events(server.grpc_url, "a red fox", modalities=["image"], **options)
    progress = [(e.stage, e.step, e.total_steps) for e in stream if e.stage]
    assert progress == [("encode", 1, 1)] + [("diffusion", i, STEPS) for i in range(1, STEPS + 1)]
    assert stream[-1].image is not None, "the image comes last"
    np.testing.assert_array_equal(stream[-1].image[0], by_hand(server.http_url, "a red fox", **options))


def test_enhance_route_streams_the_rewrite_then_diffuses_it(server):
    stream = events(server.grpc_url, "a cat", modalities=["image"], enhance_prompt=True, seed=2,
                    num_inference_steps=2)
    deltas = [e.enhanced_prompt_delta for e in stream if e.enhanced_prompt_delta is not None]
    enhanced = [e.enhanced_prompt for e in stream if e.enhanced_prompt is not None]
    assert deltas and len(enhanced) == 1
    assert enhanced[0] == ("".join(deltas).strip() or "a cat")
    kinds = [("rewrite" if e.enhanced_prompt_delta is not None or e.enhanced_prompt is not None
              else "image" if e.image is not None else e.stage) for e in stream]
    assert kinds.index("image") > kinds.index("diffusion") > kinds.index("encode") > kinds.index("rewrite")
    image = next(e.image for e in stream if e.image is not None)[0]
    np.testing.assert_array_equal(image, by_hand(server.http_url, enhanced[0], seed=2, num_inference_steps=2))


def test_hybrid_route_streams_text_and_image_in_one_stream(grpc_url):
    stream = events(grpc_url, "a harbour", modalities=["text", "image"], max_tokens=6, num_inference_steps=2,
                    num_images=2, seed=3)
    assert any(e.text for e in stream) and any(e.finish_reason for e in stream)
    images = {e.image_index[0]: e.image[0] for e in stream if e.image is not None}
    assert sorted(images) == [0, 1]
    assert not np.array_equal(images[0], images[1]), "image i is seeded with seed + i"


def test_non_streaming_routes_over_http(server):
    http = OmniClient(server.http_url, "http")
    [text] = http.generate("hello", modalities=["text"], stream=False, max_tokens=4, seed=1)
    assert text.text and text.finish_reason == "length"
    [both] = http.generate("a boat", modalities=["text", "image"], stream=False, max_tokens=4, seed=9,
                           num_inference_steps=STEPS)
    assert both.text and both.image_index == [0]
    np.testing.assert_array_equal(both.image[0],
                                  by_hand(server.http_url, "a boat", seed=9, num_inference_steps=STEPS))


def test_mixed_concurrent_traffic_all_succeeds_with_correct_outputs(server):
    kinds = {
        "text": dict(modalities=["text"], max_tokens=6),
        "image": dict(modalities=["image"], num_inference_steps=2),
        "hybrid": dict(modalities=["text", "image"], max_tokens=6, num_inference_steps=2),
        "enhanced": dict(modalities=["image"], enhance_prompt=True, num_inference_steps=2),
    }
    jobs = [(kind, f"prompt number {i}", i) for i in range(6) for kind in kinds]  # 24 requests

    def run(job):
        kind, prompt, seed = job
        return job, events(server.grpc_url, prompt, seed=seed, **kinds[kind])

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (kind, prompt, seed), stream in results:
        image = next((e.image[0] for e in stream if e.image is not None), None)
        text = "".join(e.text or "" for e in stream)
        assert (image is not None) == (kind != "text"), kind
        assert bool(text) == (kind in ("text", "hybrid")), kind
        if kind in ("image", "hybrid"):  # step batching: the image alone, within 1/255 per channel
            alone = by_hand(server.http_url, prompt, seed=seed, num_inference_steps=2)
            assert np.abs(image.astype(np.int16) - alone.astype(np.int16)).max() <= 1


# -- failures, cancellation, admission -------------------------------------------------


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sub_model_failure_is_typed_with_the_stage_message(server, protocol):
    client = OmniClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol)
    with pytest.raises(OmniError) as info:
        list(client.generate("a fox", modalities=["image"], stream=protocol == "grpc", height=500))
    assert info.value.status == "INVALID_ARG"
    assert "diffusion" in str(info.value) and "height" in str(info.value) and "500" in str(info.value)
    assert list(client.generate("still serving", modalities=["text"], stream=protocol == "grpc", max_tokens=2))


@pytest.mark.parametrize("inputs, parameter", [
    ({"modalities": ["audio"]}, "modalities"),
    ({"modalities": ["image", "video"]}, "modalities"),  # the diffusion route named twice
    ({"modalities": []}, "modalities"),
    ({"num_images": 99}, "num_images"),
    ({"parameters": '{"best_of": 2}'}, "parameters"),
])
def test_bad_scheduler_inputs_are_invalid_arg(grpc_url, inputs, parameter):
    values = {"text_input": "a fox", "stream": True, **inputs}
    with pytest.raises(OmniError) as info:
        from triton_omni_client.client import stream_infer
        list(stream_infer(grpc_url, "omni", omni_inputs(grpcclient, values)))
    assert info.value.status == "INVALID_ARG" and parameter in str(info.value)


def test_cancelling_the_stream_stops_the_diffusion_work(server):
    steps = lambda: metric_value(server, "omni_diffusion_steps_total", model="diffusion")  # noqa: E731
    cancelled = lambda: metric_value(server, "omni_diffusion_requests_total", model="diffusion",  # noqa: E731
                                     outcome="cancelled")
    succeeded = lambda: metric_value(server, "omni_diffusion_requests_total", model="diffusion",  # noqa: E731
                                     outcome="success")
    cancelled_before, succeeded_before = cancelled(), succeeded()
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    # 100 steps at 256x256: tens of seconds on the 2-core CI machine, so that the image cannot finish
    # before the cancellation reaches it (at 64x64 it once did, and the test read "never cancelled")
    client.async_stream_infer("omni", omni_inputs(grpcclient, {
        "text_input": "a long walk", "modalities": ["image"], "stream": True, "num_inference_steps": 100,
        "height": 256, "width": 256}))
    while True:  # wait until diffusion is under way
        result, error = responses.get(timeout=120)
        assert error is None, error
        step = result.as_numpy("step")
        if result.as_numpy("stage") is not None and result.as_numpy("stage")[0] == b"diffusion" and step[0] >= 2:
            break
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 30
    while cancelled() < cancelled_before + 1:
        assert time.monotonic() < deadline, \
            f"the diffusion request was never cancelled ({succeeded() - succeeded_before:g} succeeded meanwhile)"
        time.sleep(0.1)
    settled = steps()
    time.sleep(1.0)
    assert steps() == settled, "diffusion steps still running after the cancel"


def test_over_budget_embeddings_are_refused_and_counted(server):
    labels = {"model": "omni_small_budget", "reason": "embeds_budget"}
    before = metric_value(server, "omni_rejected_requests_total", **labels)
    with pytest.raises(OmniError) as info:
        list(OmniClient(server.grpc_url).generate("a red fox on a hill", modalities=["image"],
                                                  model="omni_small_budget", num_inference_steps=2))
    assert info.value.status == "UNAVAILABLE"
    assert "admission budget of 1000 bytes" in str(info.value)
    assert metric_value(server, "omni_rejected_requests_total", **labels) == before + 1
    text_only = events(server.grpc_url, "text needs no budget", modalities=["text"], model="omni_small_budget",
                       max_tokens=2)
    assert text_only[-1].finish_reason


def test_the_cli_streams_text_and_writes_the_image(server, tmp_path, capsys):
    from PIL import Image
    from triton_omni_tools.cli import main

    out = tmp_path / "omni.png"
    code = main(["generate", "a quiet lake", "--modalities", "text,image", "--url", server.grpc_url, "--out",
                 str(out), "--steps", "2", "--max-tokens", "4", "--seed", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "image 0" in captured.err and "2/2" in captured.err  # the progress bar
    assert f"wrote {out}" in captured.out
    assert Image.open(out).size == (64, 64)




def test_omni_over_http_generate_takes_options_two_ways(http_url):
    """The `options` input (`parameters` under a name Triton does not reserve) and top-level keys
    (request parameters); unknown keys are refused by name. A nested `"parameters": {...}` object
    is refused by Triton itself, since `omni` has an input of that name."""
    import json
    import urllib.error
    import urllib.request

    def post(body):
        request = urllib.request.Request(f"http://{http_url}/v2/models/omni/generate", data=json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)

    base = {"text_input": "once upon a time", "modalities": ["text"], "stream": False}
    for body in ({**base, "options": json.dumps({"max_tokens": "3", "presence_penalty": 0.5})},
                 {**base, "max_tokens": 3, "presence_penalty": "0.5"}):
        assert post(body)["finish_reason"] in ("length", "stop")
    events = list(OmniClient(http_url, "http").generate("once", stream=False, parameters={"max_tokens": "2"}))
    assert events[-1].finish_reason
    with pytest.raises(urllib.error.HTTPError) as info:
        post({**base, "temprature": 0.5})
    assert info.value.code == 400 and "temprature" in json.loads(info.value.read())["error"]
    # the client's error carries the server's status once (not again in front of the message's own tag)
    with pytest.raises(OmniError) as error:
        list(OmniClient(http_url, "http").generate("once", stream=False, parameters={"temprature": 0.5}))
    assert error.value.status == "INVALID_ARG" and "temprature" in str(error.value)
    assert str(error.value).count("[INVALID_ARG]") == 1, error.value


def test_the_cli_draws_one_progress_bar_per_image_in_a_real_terminal(server, tmp_path):
    """Run in tmux, as a user would; the screen shows one bar per image, not one per step."""
    import shlex
    import subprocess
    import sys
    import time
    import uuid
    from pathlib import Path

    session = f"omni-{uuid.uuid4().hex[:8]}"
    cli = Path(sys.executable).parent / "omni-triton"
    command = (f"{cli} generate 'a quiet lake' --modalities text,image --url {server.grpc_url} "
               f"--out {tmp_path / 'lake.png'} --steps 6 --max-tokens 8 --seed 1; echo CLI-DONE; sleep 60")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "40",
                    f"bash -c {shlex.quote(command)}"], check=True)
    try:
        screen = ""
        deadline = time.monotonic() + 120
        while "CLI-DONE" not in screen and time.monotonic() < deadline:
            time.sleep(0.5)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True, check=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    assert "CLI-DONE" in screen, screen
    bars = [line for line in screen.splitlines() if "image 0" in line]
    assert len(bars) == 1, screen
    assert "6/6" in bars[0], screen
