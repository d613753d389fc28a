"""Stages on another server (`serve --remote ar_encoder=HOST:PORT --remote diffusion=HOST:PORT`):
two servers on this machine, the front one's `ar_encoder` and `diffusion` forwarding to the stage
server's (which serves only those). `omni`, the `text_to_image` ensemble and direct calls give the
one-server answers (the suite's shared server's) bit for bit; a cancelled request is cancelled over
there; the stage server killed under load,
every request either succeeds or fails with a typed UNAVAILABLE naming the stage, none hangs;
started again on its address, the front serves the next request."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_omni_client import OmniClient, OmniError
from triton_omni_client.client import omni_inputs
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, TritonServer, free_port
from triton_omni_tools.remote import RemoteSpecError, remote_edits

from tests.support.server import metric_value

MODELS = ["ar_encoder", "diffusion", "text_to_image", "omni"]
REMOTE = ["ar_encoder", "diffusion"]  # the stage server's
OPTIONS = {"num_inference_steps": 2, "height": 32, "width": 32, "seed": 5, "guidance_scale": 4.0}
PROMPT = "a red fox"


def server_options(logs: Path, name: str, grpc_port: int, models: list[str],
                   remote: list[str] | None = None) -> ServerOptions:
    return ServerOptions(http_port=free_port(), grpc_port=grpc_port, metrics_port=free_port(),
                         model_control_mode="explicit", load_models=models, remote=remote or [],
                         log_file=logs / f"{name}.log")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The stage server, its options (to start it again), and the front server."""
    logs = tmp_path_factory.mktemp("remote")
    stage_port = free_port()
    stage_options = server_options(logs, "stages", stage_port, REMOTE)
    started = {"stages": TritonServer(stage_options).start(), "options": stage_options}
    try:
        remote = [f"{model}=127.0.0.1:{stage_port}" for model in REMOTE]
        with TritonServer(server_options(logs, "front", free_port(), MODELS, remote)) as front:
            started["front"] = front
            yield started  # the dict itself: a test that starts the stage server again puts it here
    finally:
        started["stages"].stop()  # the one running now, started again or not


def answers(url: str) -> dict[str, np.ndarray]:
    client = OmniClient(url)
    [event] = [e for e in client.generate(PROMPT, modalities=["image"], negative_prompt="blurry", **OPTIONS)
               if e.image is not None]
    embeds = client.encode(PROMPT)
    return {"encode": embeds, "diffusion": client.generate_image(prompt_embeds=embeds, **OPTIONS),
            "text_to_image": client.generate_image(PROMPT, model="text_to_image", negative_prompt="blurry", **OPTIONS),
            "omni": event.image[0]}


def test_remote_stages_give_the_one_server_answers_bit_for_bit(servers, server):
    alone, split = answers(server.grpc_url), answers(servers["front"].grpc_url)
    for route in alone:
        assert np.array_equal(alone[route], split[route]), route
    other = OmniClient(servers["front"].grpc_url).generate_image("a blue whale", model="text_to_image",
                                                                 negative_prompt="blurry", **OPTIONS)
    assert not np.array_equal(other, split["text_to_image"])  # the prompt did cross


def test_the_remote_stages_own_errors_pass_through_typed(servers):
    client = OmniClient(servers["front"].grpc_url)
    with pytest.raises(OmniError) as error:
        client.encode("word " * 5000)  # past the encoder's max_prompt_tokens, refused over there
    assert error.value.status == "INVALID_ARG" and "`text_input`" in str(error.value)  # named as over there
    assert "at most 512" in str(error.value)
    assert client.encode(PROMPT).shape[0] > 0  # and the next request served


def test_a_cancelled_request_is_cancelled_on_the_stage_server(servers):
    """omni's client leaves mid-denoising: the forwarder cancels its call, and the stage server's
    diffusion drops the request at its next step."""
    stages = servers["stages"]
    count = lambda outcome: metric_value(stages, "omni_diffusion_requests_total",  # noqa: E731
                                         model="diffusion", outcome=outcome)
    steps = lambda: metric_value(stages, "omni_diffusion_steps_total", model="diffusion")  # noqa: E731
    cancelled_before, started = count("cancelled"), steps()
    client = grpcclient.InferenceServerClient(servers["front"].grpc_url)
    client.start_stream(callback=lambda result, error: None)
    # 100 steps at 128x128: seconds here, far longer than the cancel takes to arrive
    client.async_stream_infer("omni", omni_inputs(grpcclient, {
        "text_input": "a long walk", "modalities": ["image"], "stream": True, "num_inference_steps": 100,
        "height": 128, "width": 128}))
    deadline = time.monotonic() + 120
    while steps() < started + 2:  # denoising over there
        assert time.monotonic() < deadline, "the request never reached the stage server's diffusion"
        time.sleep(0.1)
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 30
    while count("cancelled") < cancelled_before + 1:
        assert time.monotonic() < deadline, "the stage server's diffusion request was never cancelled"
        time.sleep(0.1)
    settled = steps()
    time.sleep(1.0)
    assert steps() == settled and steps() - started < 100, "steps still running over there after the cancel"


def test_a_stage_that_streams_cannot_be_remote():
    with pytest.raises(RemoteSpecError, match="'ar' streams its answers"):
        remote_edits(["ar=127.0.0.1:1"], list(DEFAULT_REPOSITORIES))
    with pytest.raises(RemoteSpecError, match="no model 'encoder'"):
        remote_edits(["encoder=127.0.0.1:1"], list(DEFAULT_REPOSITORIES))
    with pytest.raises(RemoteSpecError, match="MODEL=HOST:PORT"):
        remote_edits(["ar_encoder"], list(DEFAULT_REPOSITORIES))


def test_the_stage_server_killed_under_load_fails_requests_typed_and_none_hangs(servers):
    url = servers["front"].grpc_url
    embeds = OmniClient(url).encode(PROMPT)
    stop, served = threading.Event(), threading.Semaphore(0)  # released once per request that succeeded

    def load(worker: int) -> list[str]:
        """Requests one after another until told to stop: each one's outcome."""
        outcomes, client = [], OmniClient(url)
        while not stop.is_set():
            try:
                client.generate_image(f"{PROMPT} {worker} {len(outcomes)}", model="text_to_image", **OPTIONS)
                outcomes.append("ok")
                served.release()
            except OmniError as error:
                assert error.status == "UNAVAILABLE" and "remote stage" in str(error), error
                outcomes.append("unavailable")
        return outcomes

    stages = servers["stages"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load, worker) for worker in range(4)]
        for _ in range(2):  # under way: requests served before the kill, whatever the host's speed
            assert served.acquire(timeout=120), "no request succeeded before the kill"
        os.killpg(stages.process.pid, signal.SIGKILL)
        time.sleep(4.0)  # past the retries' 1.5 s: requests sent while it is down fail too
        stop.set()
        outcomes = [outcome for f in futures for outcome in f.result(timeout=120)]  # none hangs
    stages.stop()
    assert "ok" in outcomes and "unavailable" in outcomes, outcomes
    front = OmniClient(url)
    for call, stage in ((lambda: front.encode(PROMPT), "ar_encoder"),
                        (lambda: front.generate_image(prompt_embeds=embeds, **OPTIONS), "diffusion")):
        with pytest.raises(OmniError) as error:  # while it is down: typed, after the bounded retries
            call()
        assert error.value.status == "UNAVAILABLE" and f"remote stage {stage}" in str(error.value)
        assert "unreachable" in str(error.value)

    servers["stages"] = TritonServer(servers["options"]).start()  # back on its address
    deadline = time.monotonic() + 30
    while True:
        try:
            assert front.generate_image(PROMPT, model="text_to_image", **OPTIONS).shape == (32, 32, 3)
            break
        except OmniError:
            assert time.monotonic() < deadline, "the front never reached the stage server again"
            time.sleep(0.5)
