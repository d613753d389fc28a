"""A server told to stop (what a pod scaled in gets: SIGTERM, which `serve` turns into Triton's
graceful stop) finishes the request it holds, its denoising steps included, within its exit
timeout, and is not ready meanwhile (the Service takes the pod out). A request that reaches it
during the drain is either served (Triton 2.51 takes it until it starts unloading the model) or
refused as the model being gone (NOT_FOUND), which a front's forwarder sends to another replica:
with two replicas behind one address, every request of a load goes on succeeding while one leaves."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from triton_omni_client import OmniClient, OmniError
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

from tests.support.server import metric_value

LONG = {"num_inference_steps": 40, "height": 32, "width": 32, "guidance_scale": 7.5, "seed": 1}


def ready(server: TritonServer) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_a_stopping_server_finishes_the_denoising_it_holds(tmp_path):
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            model_control_mode="explicit", load_models=["ar_encoder", "diffusion"],
                            exit_timeout_s=120, log_file=tmp_path / "tritonserver.log")
    server = TritonServer(options).start()
    try:
        client = OmniClient(server.grpc_url)
        embeds = client.encode("a red fox")
        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(client.generate_image, prompt_embeds=embeds, **LONG)
            deadline = time.monotonic() + 60
            while metric_value(server, "omni_diffusion_requests_in_flight", model="diffusion") < 1:
                assert time.monotonic() < deadline, "the request never reached the model"
                time.sleep(0.05)
            started = time.monotonic()
            stopping = pool.submit(server.stop)
            while ready(server):
                assert time.monotonic() - started < 10, "still ready after it was told to stop"
                time.sleep(0.05)
            try:
                late = client.generate_image(prompt_embeds=embeds, **LONG | {"num_inference_steps": 1})
                assert late.shape == (32, 32, 3)
            except OmniError as refused:  # the model unloading; or, the drain over, the server gone
                assert refused.status in ("NOT_FOUND", "UNAVAILABLE"), refused
            image = held.result(timeout=150)  # in flight when the stop began: finished, not cut short
            print(f"held request finished {time.monotonic() - started:.1f} s into the drain")
            assert stopping.result(timeout=150) == 0  # a clean exit, nothing killed
    finally:
        server.stop()
    assert image.shape == (32, 32, 3) and np.ptp(image) > 0


def served_by(server: TritonServer) -> float:
    return metric_value(server, "nv_inference_request_success", model="diffusion")


def test_a_replica_scaled_in_under_load_is_routed_around(tmp_path):
    """Two replicas of a stage behind one address, as a headless Service's pods are: one is stopped
    (scaled in) while a front forwards a steady load to them. What it refuses while it unloads, or
    can no longer be reached for, the front's forwarder sends to the other: every request succeeds,
    and the other replica serves on."""
    def replica(name: str) -> ServerOptions:
        return ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                             model_control_mode="explicit", load_models=["diffusion"],
                             log_file=tmp_path / f"{name}.log")

    with ThreadPoolExecutor(2) as pool:  # both start at once: a start is most of this test's time
        leaving, staying = pool.map(lambda options: TritonServer(options).start(), [replica("a"), replica("b")])
    front = None
    try:
        # gRPC's list of addresses (IP literals), balanced round robin as a headless Service's are
        address = "ipv4:" + ",".join(f"127.0.0.1:{s.options.grpc_port}" for s in (leaving, staying))
        front = TritonServer(ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                           model_control_mode="explicit", load_models=["diffusion"],
                                           remote=[f"diffusion={address}"], log_file=tmp_path / "front.log")).start()
        embeds = np.random.default_rng(0).standard_normal((7, 128)).astype(np.float32)
        stop, served = threading.Event(), threading.Semaphore(0)

        def load() -> list[str]:
            outcomes, client = [], OmniClient(front.grpc_url)
            while not stop.is_set():
                try:
                    client.generate_image(prompt_embeds=embeds, num_inference_steps=4, height=32, width=32, seed=1)
                    outcomes.append("ok")
                    served.release()
                except OmniError as error:
                    outcomes.append(f"{error.status}: {error}")
            return outcomes

        with ThreadPoolExecutor(3) as pool:
            workers = [pool.submit(load) for _ in range(3)]
            try:
                for _ in range(4):
                    assert served.acquire(timeout=120), "no request served before the scale-in"
                leaving.stop()  # SIGINT: Triton's drain, then the models unload and the server exits
                before, deadline = served_by(staying), time.monotonic() + 120
                while served_by(staying) < before + 4:  # the load goes on, on the replica left
                    assert time.monotonic() < deadline, "the replica left served nothing after the scale-in"
                    time.sleep(0.2)
            finally:
                stop.set()  # the workers end whatever happened
            outcomes = [outcome for worker in workers for outcome in worker.result(timeout=120)]
        assert set(outcomes) == {"ok"}, [outcome for outcome in outcomes if outcome != "ok"]
    finally:
        for server in (front, leaving, staying):
            if server is not None:
                server.stop()
