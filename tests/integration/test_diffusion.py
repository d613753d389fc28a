"""The `diffusion` model on a real server: both inputs, both batching modes
(step, the default; request batching padded to a fixed size, `diffusion_exact`),
bad inputs, cancellation.

Tolerance: under step batching an image computed in company differs from the
same request alone by at most 1/255 per pixel channel; padded request
batching is bit-identical."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image
from triton_omni_client import OmniClient, OmniError
from triton_omni_client.client import batched_inputs

from tests.support.server import metric_value, require_alive

FAST = {"num_inference_steps": 2, "height": 32, "width": 32}


def embeds(seed: int, tokens: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, 128)).astype(np.float32)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_prompt_and_prompt_embeds_give_images(server, protocol):
    client = OmniClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol)
    for inputs in ({"prompt": "a red fox"}, {"prompt_embeds": embeds(0)}):
        image = client.generate_image(**inputs, seed=1, **FAST | {"height": 48, "width": 40})
        assert image.dtype == np.uint8 and image.shape == (48, 40, 3)
        assert image.std() > 0


def test_embeddings_from_ar_encoder_condition_the_image(grpc_url):
    client = OmniClient(grpc_url)
    prompt_embeds = client.encode("a watercolor lighthouse")
    image = client.generate_image(prompt_embeds=prompt_embeds, seed=2, **FAST)
    assert image.shape == (32, 32, 3)


def test_cli_writes_a_png(grpc_url, tmp_path):
    out = tmp_path / "fox.png"
    cli = Path(sys.executable).parent / "omni-triton"
    subprocess.run([str(cli), "generate-image", "a red fox", "--out", str(out), "--url", grpc_url,
                    "--steps", "2", "--seed", "3", "--height", "32", "--width", "48"], check=True)
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (48, 32)


def test_cli_streams_progress_from_a_decoupled_diffusion(grpc_url, tmp_path):
    out = tmp_path / "fox.png"
    cli = Path(sys.executable).parent / "omni-triton"
    done = subprocess.run([str(cli), "generate-image", "a red fox", "--out", str(out), "--url", grpc_url, "--stream",
                           "--steps", "4", "--seed", "3", "--height", "32", "--width", "32"],
                          check=True, capture_output=True, text=True)
    assert "4/4" in done.stderr, done.stderr  # the bar reached the last step
    with Image.open(out) as image:
        assert image.size == (32, 32)


# Eight mixed requests: text and embeddings, different seeds, guidance on and off, two sizes.
MIXED = [
    {"prompt": "a red fox", "seed": 1},
    {"prompt": "a red fox", "seed": 2},
    {"prompt": "a blue cat", "seed": 1, "guidance_scale": 4.0},
    {"prompt_embeds": embeds(1), "seed": 5},
    {"prompt_embeds": embeds(2), "seed": 5, "guidance_scale": 3.0},
    {"prompt": "a lighthouse", "seed": 9, "height": 40},
    {"prompt": "a lighthouse", "seed": 9, "negative_prompt": "fog", "guidance_scale": 5.0},
    {"prompt_embeds": embeds(1), "seed": 6},
]


# max difference per uint8 channel; diffusion_pair: two step-batching instances sharing the requests
TOLERANCE = {"diffusion": 1, "diffusion_exact": 0, "diffusion_pair": 1}


def _generate(client, request, model: str = "diffusion"):
    return client.generate_image(**(FAST | {"guidance_scale": 1.0} | request), model=model)


def assert_same_image(a: np.ndarray, b: np.ndarray, model: str, message: str) -> None:
    difference = int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
    assert difference <= TOLERANCE[model], f"{message}: max pixel difference {difference}"


@pytest.mark.parametrize("model", list(TOLERANCE))
def test_batched_images_equal_images_computed_alone(grpc_url, http_url, model):
    client = OmniClient(grpc_url)
    alone = [_generate(client, r, model) for r in MIXED]
    with concurrent.futures.ThreadPoolExecutor(len(MIXED)) as pool:
        together = list(pool.map(lambda r: _generate(OmniClient(http_url, "http"), r, model), MIXED))
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert_same_image(a, b, model, f"request {i} changed when batched")
    assert not np.array_equal(alone[0], alone[1]), "different seeds must give different images"
    assert not np.array_equal(alone[3], alone[7]), "different seeds must give different images"


def test_request_batching_batches(http_url):
    import tritonclient.http as httpclient

    def counts():
        with httpclient.InferenceServerClient(http_url) as c:
            stats = c.get_inference_statistics("diffusion_exact")["model_stats"][0]
        return stats["inference_count"], stats["execution_count"]

    def settled() -> tuple[int, int]:
        """The counts once they stop moving: a batch's statistics are recorded when its execute
        returns, which can be after its responses reached the clients (they leave from the
        response thread)."""
        deadline = time.monotonic() + 30
        previous = counts()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            current = counts()
            if current == previous:
                return current
            previous = current
        return previous

    before = settled()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda r: _generate(OmniClient(http_url, "http"), r, "diffusion_exact"), [MIXED[0]] * 8))
    deadline = time.monotonic() + 30
    while (after := counts())[0] < before[0] + 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    # a straggler of an earlier test counted after `settled` adds to both counts alike
    assert after[0] - before[0] >= 8 and after[1] - before[1] < after[0] - before[0]


def test_step_batching_shares_steps(server):
    """Concurrent requests ran in shared denoising steps: the batch-size
    histogram (requests per step) saw more than one request per step."""
    def histogram():
        return (metric_value(server, "omni_diffusion_batch_size_sum", model="diffusion"),
                metric_value(server, "omni_diffusion_batch_size_count", model="diffusion"))

    (sum_before, count_before) = histogram()
    long = FAST | {"num_inference_steps": 8}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda seed: OmniClient(server.grpc_url).generate_image("a red fox", seed=seed, **long),
                      range(4)))
    (sum_after, count_after) = histogram()
    steps, requests_stepped = count_after - count_before, sum_after - sum_before
    assert requests_stepped == 4 * 8  # every step of every request, once
    assert steps < 4 * 8, "no step ran two requests at once"


def test_two_step_batching_instances_share_a_burst_evenly(server):
    """Eight requests at once to two instances whose execute returns at once:
    each instance takes four (triton/balance.py), so no denoising step ever
    ran more than four requests. Triton alone gave one instance seven."""
    def histogram():
        at_most_four = sum(metric_value(server, "omni_diffusion_batch_size_bucket", model="diffusion_pair", le=le)
                           for le in ("4", "4.0"))  # however the server writes the bound
        return (at_most_four,
                metric_value(server, "omni_diffusion_batch_size_count", model="diffusion_pair"))

    before = histogram()
    long = FAST | {"num_inference_steps": 8}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        images = list(pool.map(lambda seed: OmniClient(server.grpc_url).generate_image(
            "a red fox", seed=seed, model="diffusion_pair", **long), range(8)))
    assert len(images) == 8
    after = histogram()
    steps, at_most_four = after[1] - before[1], after[0] - before[0]
    assert steps > 0 and at_most_four == steps, f"{steps - at_most_four} of {steps} steps ran more than 4 requests"


def test_a_full_instance_leaves_the_next_request_to_a_sibling_with_room(grpc_url):
    """Two instances with room for two guided requests each. Three long
    requests and a short one fill both; the short one finishes, and from
    then on every short request must go to the instance with room, never
    wait in the full one's engine behind a long image: a full instance keeps
    ``execute`` (triton/balance.py). Without that, Triton gave about every
    other short request to the full instance, where it waited for one of
    the long images to finish.

    What is checked is the order, not a time: a short request that waited
    in a full engine is answered only after a long request finished there,
    so every short one answered before the first long one proves that none
    waited. The shorts are small and unguided (one row, a fraction of a
    long step), so the whole sequence of them takes a few of a long
    request's sixty steps even on two busy cores. The model's ``full_hold_s``
    (600 s) outlasts the long requests: with the default 30 s a full instance
    on two busy cores took requests again before its long ones ended (most
    likely the failure a wall-clock bound here once saw: a short request's
    wait then matched a long one's time less 30 s)."""
    client = grpcclient.InferenceServerClient(grpc_url)
    longs: list[tuple[float, object]] = []
    done = threading.Semaphore(0)

    def callback(result, error):
        longs.append((time.monotonic(), error))
        done.release()

    for seed in range(3):  # the demo default size, guided: seconds each on a CPU
        inputs = batched_inputs(grpcclient, prompt="a red fox", seed=seed, num_inference_steps=60)
        client.async_infer("diffusion_pair_small", inputs, callback)
    shorts = OmniClient(grpc_url)

    def short(seed: int) -> float:
        shorts.generate_image("a red fox", seed=seed, model="diffusion_pair_small", num_inference_steps=1,
                              height=32, width=32, guidance_scale=1.0)
        return time.monotonic()

    short(3)  # it fills the instance with one long request: both are busy from here on
    answered = [short(seed) for seed in range(4, 10)]
    for _ in range(3):
        assert done.acquire(timeout=300), "a long request was never answered"
    client.close()
    assert all(error is None for _, error in longs)
    first_long = min(at for at, _ in longs)
    late = [i for i, at in enumerate(answered) if at > first_long]
    assert not late, f"short requests {late} were answered after a long one: one waited behind it"


def test_step_batching_survives_a_burst_of_requests(server):
    """Hundreds of requests sent without waiting (the open-loop bench's
    traffic): every one answered, the server up, the metrics counting all.
    Regression: with metric updates made from the step engine's thread
    beside the response thread's sends, tritonserver 2.51 crashed after a
    few hundred such requests (metrics.Routed)."""
    def succeeded():
        return metric_value(server, "omni_diffusion_requests_total", model="diffusion", outcome="success")

    before, total = succeeded(), 600
    done, errors = threading.Semaphore(0), []

    def callback(result, error):
        if error is not None or result.as_numpy("image") is None:
            errors.append(error)
        done.release()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = batched_inputs(grpcclient, prompt="a red fox", seed=1, num_inference_steps=1, height=32, width=32,
                            guidance_scale=1.0)
    for i in range(total):
        client.async_infer("diffusion", inputs, callback)
        if i % 50 == 49:
            time.sleep(0.5)  # about 100 requests/s: a queue, never the whole burst at once
    for _ in range(total):
        assert done.acquire(timeout=120), "a request was never answered"
    client.close()
    assert not errors, f"{len(errors)} failed; first: {errors[0]}"
    require_alive(server)
    assert succeeded() - before == total


def _bad(**values):
    return values


BAD_INPUTS = {
    "both prompt and embeds": (_bad(prompt="x", prompt_embeds=embeds(0)), "prompt"),
    "neither prompt nor embeds": (_bad(seed=1), "prompt"),
    "3-D embeddings": (_bad(prompt_embeds=np.zeros((2, 3, 128), np.float32)), "prompt_embeds"),
    "wrong hidden size": (_bad(prompt_embeds=np.zeros((4, 64), np.float32)), "prompt_embeds"),
    "too many tokens": (_bad(prompt_embeds=np.zeros((600, 128), np.float32)), "prompt_embeds"),
    "NaN embeddings": (_bad(prompt_embeds=np.full((4, 128), np.nan, np.float32)), "prompt_embeds"),
    "height 500": (_bad(prompt="x", height=500), "height"),
    "height too large": (_bad(prompt="x", height=4096), "height"),
    "steps 0": (_bad(prompt="x", num_inference_steps=0), "num_inference_steps"),
    "too many steps": (_bad(prompt="x", num_inference_steps=5000), "num_inference_steps"),
    "negative guidance": (_bad(prompt="x", guidance_scale=-1.0), "guidance_scale"),
    "an adapter the model lacks": (_bad(prompt="x", lora="anime"), "lora"),
    "a scale without an adapter": (_bad(prompt="x", lora_scale=0.5), "lora_scale"),
    # (a different token count is fine: the shorter side is padded)
    "negative embeds width": (_bad(prompt_embeds=embeds(0), negative_prompt_embeds=np.zeros((3, 64), np.float32),
                                   guidance_scale=3.0), "negative_prompt_embeds"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_invalid_arg(http_url, case):
    values, parameter = BAD_INPUTS[case]
    with pytest.raises(OmniError) as info:
        OmniClient(http_url, "http").generate_image(**(FAST | values))
    assert info.value.status == "INVALID_ARG", info.value
    assert parameter in str(info.value)


def test_valid_requests_batched_with_bad_ones_succeed(http_url):
    cases = [MIXED[0], BAD_INPUTS["NaN embeddings"][0], MIXED[3], BAD_INPUTS["height 500"][0], MIXED[1]]
    client = OmniClient(http_url, "http")
    expected = {i: _generate(client, cases[i]) for i in (0, 2, 4)}

    def attempt(request):
        try:
            return _generate(OmniClient(http_url, "http"), request)
        except OmniError as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        outcomes = list(pool.map(attempt, cases))
    for i, image in expected.items():
        assert_same_image(outcomes[i], image, "diffusion", f"request {i}")
    assert isinstance(outcomes[1], OmniError) and isinstance(outcomes[3], OmniError)


def test_grpc_cancel_stops_within_one_step(server):
    steps = lambda: metric_value(server, "omni_diffusion_steps_total", model="diffusion")  # noqa: E731
    long_request = {"prompt": "a very slow painting", "num_inference_steps": 100, "height": 128, "width": 128,
                    "guidance_scale": 1.0, "seed": 1}
    before = steps()
    done = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        call = client.async_infer("diffusion", batched_inputs(grpcclient, **long_request),
                                  callback=lambda result, error: done.append(error))
        deadline = time.monotonic() + 120
        while steps() - before < 3:
            assert time.monotonic() < deadline, "diffusion never started"
            time.sleep(0.05)
        call.cancel()
        at_cancel = steps() - before
        time.sleep(3.0)
        settled = steps() - before
    # One step may be in flight when the cancel lands, and the metric lags a little.
    assert settled <= at_cancel + 2, f"{settled - at_cancel} steps ran after the cancel"
    assert settled < 100
    deadline = time.monotonic() + 60  # the interrupted batch still runs its VAE decode
    while metric_value(server, "omni_diffusion_requests_total", model="diffusion", outcome="cancelled") < 1:
        assert time.monotonic() < deadline, "the cancelled request was never counted as cancelled"
        time.sleep(0.2)


def test_a_decoupled_diffusion_streams_each_step_then_the_image(server):
    """``diffusion_stream`` (the default config with ``decoupled: true``):
    over a gRPC stream, progress responses (``step``, ``total_steps``) in
    order, then the image, the same as the non-streaming model's."""
    options = FAST | {"num_inference_steps": 6, "seed": 3}
    steps = []
    client = OmniClient(server.grpc_url)
    image = client.stream_image("a red fox", on_progress=lambda step, total: steps.append((step, total)), **options)
    assert steps and steps == sorted(steps) and steps[-1] == (6, 6)
    assert all(total == 6 for _, total in steps)
    assert_same_image(image, client.generate_image("a red fox", **options), "diffusion", "streamed vs not")


def test_a_decoupled_diffusion_refuses_bad_input_by_name(server):
    with pytest.raises(OmniError, match="num_inference_steps") as error:
        OmniClient(server.grpc_url).stream_image("a red fox", num_inference_steps=0)
    assert error.value.status == "INVALID_ARG"


@pytest.mark.parametrize("route", ["text_to_image", "omni"])
def test_the_ensemble_and_omni_hand_lora_to_diffusion(grpc_url, route):
    """They pass it on: the SD demo's diffusion serves no adapters, and says so naming it."""
    client = OmniClient(grpc_url)
    with pytest.raises(OmniError) as refused:
        if route == "omni":
            list(client.generate("a fox", modalities=["image"], lora="anime", num_inference_steps=2))
        else:
            client.generate_image("a fox", model=route, lora="anime", num_inference_steps=2)
    assert refused.value.status == "INVALID_ARG" and "lora" in str(refused.value)
    assert "serves no LoRA adapters" in str(refused.value)
