"""What a stage on another server costs a request: `text_to_image` on one server against the same
ensemble on a front server whose `ar_encoder` and `diffusion` are forwarded (`serve --remote`) to
the first, interleaved request by request (who goes first alternates) so that noise hits both
alike. Both servers on this host: the hop is loopback gRPC plus the forwarders' stubs, not a
network.

Prints p50/p99 latency of each, their ratio (split / one server) and the milliseconds the split
adds; the images must be equal bit for bit. On a CPU with the tiny demo models the stages take
little time, so the hop is what shows.

    .venv/bin/python benchmarks/remote_stage.py --requests 40
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from triton_omni.demo_models import build_all
from triton_omni_client.client import batched_inputs
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

PROMPT = "a lighthouse on a cliff at dusk"
STAGES = ["ar_encoder", "diffusion"]


def options(logs: Path, name: str, grpc_port: int, remote: list[str]) -> ServerOptions:
    return ServerOptions(http_port=free_port(), grpc_port=grpc_port, metrics_port=free_port(),
                         model_control_mode="explicit", load_models=[*STAGES, "text_to_image"], remote=remote,
                         log_file=logs / f"{name}.log")


def ensemble(client, request: dict) -> np.ndarray:
    return client.infer("text_to_image", batched_inputs(grpcclient, text_input=PROMPT, **request)).as_numpy("image")


def measure(urls: dict[str, str], requests: int, request: dict) -> dict[str, list[float]]:
    clients = {name: grpcclient.InferenceServerClient(url) for name, url in urls.items()}
    first = {name: ensemble(client, request) for name, client in clients.items()}  # warm-up
    assert np.array_equal(*first.values()), "the split must compute the one-server image"
    latencies: dict[str, list[float]] = {name: [] for name in clients}
    order = list(clients)
    for i in range(requests):
        for name in order[i % 2:] + order[: i % 2]:
            start = time.perf_counter()
            ensemble(clients[name], request)
            latencies[name].append(time.perf_counter() - start)
    return latencies


def report(latencies: dict[str, list[float]], request: dict) -> None:
    stats = {name: (np.percentile(v, 50) * 1e3, np.percentile(v, 99) * 1e3) for name, v in latencies.items()}
    one, split = stats["one server"], stats["split"]
    print(f"\ntext_to_image ({request['num_inference_steps']} steps, {request['height']}x{request['width']}), "
          f"{len(latencies['split'])} requests each, concurrency 1, {platform.processor() or platform.machine()}")
    print(f"{'':<12}{'p50 ms':>10}{'p99 ms':>10}")
    for name, (p50, p99) in stats.items():
        print(f"{name:<12}{p50:>10.1f}{p99:>10.1f}")
    print(f"split / one server: p50 {split[0] / one[0]:.2f}, p99 {split[1] / one[1]:.2f}; "
          f"the hop adds {split[0] - one[0]:.1f} ms at p50")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--size", type=int, default=32)
    args = parser.parse_args()
    request = {"num_inference_steps": args.steps, "height": args.size, "width": args.size, "seed": 1,
               "guidance_scale": 1.0}
    build_all()
    logs = Path(tempfile.mkdtemp(prefix="remote-stage-bench-"))
    stage_port = free_port()
    with TritonServer(options(logs, "stages", stage_port, [])) as stages, \
            TritonServer(options(logs, "front", free_port(),
                                 [f"{model}=127.0.0.1:{stage_port}" for model in STAGES])) as front:
        report(measure({"one server": stages.grpc_url, "split": front.grpc_url}, args.requests, request), request)


if __name__ == "__main__":
    main()
