"""A stub killed under load: readiness says so within 5 s, the model serves
again within 60 s, requests to the models that do not depend on it all
succeed throughout, and nothing is left in flight."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from triton_omni_client import OmniClient, OmniError
from triton_omni_client.client import batched_inputs, omni_inputs, stream_infer
from triton_omni_tools.supervisor import server_stubs

from tests.support.probes import Prober, passed, would_restart
from tests.support.server import LONG_RELIABILITY as LONG
from tests.support.server import metric_value, model_ready, xfail_if_triton_aborted_on_a_dead_stub

FAST = {"num_inference_steps": 2, "height": 32, "width": 32, "guidance_scale": 1.0}


# A client deadline: a request in flight on a stub that dies while the model answers it through
# its response sender (step-batching diffusion, ar_encoder on vLLM, the decoupled models) is never
# answered by Triton 2.51, which forgets it with the stub (docs/operations.md).
DEADLINE_S = 30


def diffusion(url: str) -> None:
    with grpcclient.InferenceServerClient(url) as client:
        inputs = batched_inputs(grpcclient, prompt="a red fox", seed=1, **FAST)
        assert client.infer("diffusion", inputs, client_timeout=DEADLINE_S).as_numpy("image") is not None


def ar_encoder(url: str) -> None:
    with grpcclient.InferenceServerClient(url) as client:
        assert client.infer("ar_encoder", batched_inputs(grpcclient, text_input="a red fox"),
                            client_timeout=DEADLINE_S).as_numpy("prompt_embeds") is not None


def ar(url: str) -> None:
    values = {"text_input": "a red fox", "max_tokens": 4}
    assert list(stream_infer(url, "ar", omni_inputs(grpcclient, values), timeout_s=DEADLINE_S))


def omni(url: str) -> None:
    values = {"text_input": "a red fox", "modalities": ["text"], "max_tokens": 4}
    assert list(stream_infer(url, "omni", omni_inputs(grpcclient, values), timeout_s=DEADLINE_S))


CALLS = {"diffusion": diffusion, "ar_encoder": ar_encoder, "ar": ar, "omni": omni}
# model killed -> a model that does not depend on it, loaded meanwhile
BYSTANDER = {"diffusion": "ar_encoder", "ar_encoder": "diffusion", "ar": "diffusion", "omni": "ar_encoder"}
KILLED = list(CALLS) if LONG else ["diffusion"]



class Load:
    """Closed-loop requests to one model on a thread, counting every outcome."""

    def __init__(self, call, url: str):
        self.call, self.url = call, url
        self.sent = self.succeeded = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sent += 1
            try:
                self.call(self.url)
                self.succeeded += 1
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)  # the model is away: no need to spin

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=DEADLINE_S + 30)
        assert not self._thread.is_alive(), "a request hung"


@pytest.mark.parametrize("model", KILLED)
def test_a_killed_stub_is_noticed_and_its_model_serves_again(supervised, model):
    url = supervised.grpc_url
    CALLS[model](url)
    restarts_before = metric_value(supervised, "omni_stage_restarts_total", model=model)
    [stub, *_] = [s for s in server_stubs(supervised.process.pid) if s.model == model]
    with Load(CALLS[BYSTANDER[model]], url) as bystander, Load(CALLS[model], url) as victim, \
            Prober(supervised.http_url) as probes:
        time.sleep(1)
        noticed, back = kill_and_watch(supervised, model, stub.pid)
        time.sleep(1)
    xfail_if_triton_aborted_on_a_dead_stub(supervised)
    # deploy/kubernetes.yaml's probes: the pod leaves the Service while the model is away, and is not restarted
    ready = [passed(status) for status in probes.statuses("readinessProbe")]
    assert False in ready and True in ready[ready.index(False):], probes.statuses("readinessProbe")  # out, back in
    assert not would_restart(probes.seen["livenessProbe"]), probes.statuses("livenessProbe")
    print(f"{model}: not ready after {noticed:.1f} s, serving again after {back:.1f} s; "
          f"{victim.sent} sent to it meanwhile, {victim.succeeded} succeeded, errors: "
          f"{sorted(set(e[:90] for e in victim.errors))}")
    assert noticed <= 5, f"readiness still true {noticed:.1f} s after the kill"
    assert back <= 60, f"{model} not serving again {back:.1f} s after the kill"
    CALLS[model](url)
    assert bystander.errors == [] and bystander.succeeded == bystander.sent > 0
    assert victim.sent == victim.succeeded + len(victim.errors)  # every request answered, none hanging
    assert metric_value(supervised, "omni_stage_restarts_total", model=model) == restarts_before + 1
    assert_nothing_in_flight(supervised, model)
    assert_reaped(stub.pid)
    with urllib.request.urlopen(f"http://{supervised.http_url}/v2/health/ready", timeout=5) as response:
        assert response.status == 200


def test_an_omni_image_waiting_on_a_dying_diffusion_fails_fast(supervised):
    """``omni`` waits on ``diffusion`` through BLS. When diffusion's stub dies,
    Triton 2.51 never answers that sub-request; ``omni`` watches the
    supervisor's restart count and fails it with UNAVAILABLE within seconds,
    where the client used to wait for its own deadline (triton/stages.py)."""
    url = supervised.grpc_url
    wait_until_ready(supervised, "diffusion")
    [stub, *_] = [s for s in server_stubs(supervised.process.pid) if s.model == "diffusion"]
    diffusing, outcome = threading.Event(), []

    def request() -> None:
        try:
            for event in OmniClient(url).generate("a red fox", modalities=["image"], num_inference_steps=100):
                if event.stage == "diffusion":
                    diffusing.set()
            outcome.append("image")
        except OmniError as exc:
            outcome.append(exc.status)

    thread = threading.Thread(target=request)
    thread.start()
    assert diffusing.wait(60), "the request never reached diffusion"
    os.kill(stub.pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(DEADLINE_S)
    answered = time.monotonic() - killed
    xfail_if_triton_aborted_on_a_dead_stub(supervised)
    assert not thread.is_alive(), "the omni request hung"
    assert outcome == ["UNAVAILABLE"] and answered < 10, (outcome, answered)
    wait_until_ready(supervised, "diffusion")  # back, for the tests after this one


STAGE = {"diffusion": "diffusion", "ar_encoder": "ar", "ar": "ar", "omni": "scheduler"}


def assert_nothing_in_flight(server, model: str, timeout_s: float = 5) -> None:
    """The requests the killed stub held left its in-flight gauge with it (metric updates are asynchronous)."""
    name = f"omni_{STAGE[model]}_requests_in_flight"
    deadline = time.monotonic() + timeout_s
    while (value := metric_value(server, name, model=model)) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert value == 0, f"{name}{{model={model}}} is {value} with no request in flight"


def assert_reaped(pid: int, timeout_s: float = 5) -> None:
    """The killed stub is gone from the process table, not a zombie of tritonserver's until it stops."""
    deadline = time.monotonic() + timeout_s
    while (state := process_state(pid)) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert state is None, f"the killed stub {pid} is still in the process table (state {state})"


def process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def kill_and_watch(server, model: str, pid: int, timeout_s: float = 120) -> tuple[float, float]:
    """SIGKILL a stub of ``model``: (seconds until the model is not ready, until it is ready again)."""
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while model_ready(server, model) and time.monotonic() - killed < 10:
        time.sleep(0.1)
    noticed = time.monotonic() - killed
    while not model_ready(server, model) and time.monotonic() - killed < timeout_s and server.process.poll() is None:
        time.sleep(0.2)
    return noticed, time.monotonic() - killed


def wait_until_ready(server, model: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not model_ready(server, model):
        if server.process.poll() is not None:  # the Triton defect can strike while the stub restarts too
            xfail_if_triton_aborted_on_a_dead_stub(server)
            raise AssertionError(f"tritonserver exited ({server.process.returncode}) while {model} restarted")
        assert time.monotonic() < deadline, f"{model} not ready after {timeout_s} s"
        time.sleep(0.2)
