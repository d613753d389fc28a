"""What a stage on another server costs a request: the same requests sent to one server and to a
front server whose stages are forwarded (`serve --remote`) to it, interleaved so that noise hits
both alike, with the one server measured a second time beside them (an A/A: how finely this host
tells two identical arms apart).

Two routes:

- default: `text_to_image` (prompts) with the tiny demo models, `ar_encoder` and `diffusion` both
  forwarded. On a CPU the stages take little time, so the hop is what shows.
- `--family F --preset P`: `diffusion` alone with a family's embeddings (as `families.py` sends
  them), forwarded: on a GPU host, `--family qwen-image --preset realistic` is the 20 B DiT at
  1024², 50 steps, true CFG.

Both servers run on this host, so the hop is loopback gRPC plus the forwarder's stub, not a
network. Prints, for each arm, p50/p99 latency at concurrency 1 and images/s at `--concurrency`
(requests sent together, rounds rotating between the arms), then split / one server and the A/A
(one server / one server) beside it. The first images of the arms must be equal bit for bit.

    .venv/bin/python benchmarks/remote_stage.py --requests 40
    python benchmarks/remote_stage.py --family qwen-image --preset realistic --requests 4 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from triton_omni_client import OmniClient
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

PROMPT = "a lighthouse on a cliff at dusk"
ARMS = ("one server", "split", "one server again")  # the last: the A/A

Call = Callable[[OmniClient, int], np.ndarray]  # request i's image, from a client


def tiny_route(args) -> tuple[list[Path] | None, list[str], list[str], Call]:
    """The repositories (None: the defaults), the models to load, those forwarded, and the call."""
    from triton_omni.demo_models import build_all

    build_all()
    request = {"num_inference_steps": args.steps or 1, "height": 32, "width": 32, "guidance_scale": 1.0}

    def call(client: OmniClient, i: int) -> np.ndarray:
        return client.generate_image(f"{PROMPT} {i}", model="text_to_image", seed=i, **request)

    return None, ["ar_encoder", "diffusion", "text_to_image"], ["ar_encoder", "diffusion"], call


def family_route(args, tmp: Path) -> tuple[list[Path] | None, list[str], list[str], Call]:
    import dataclasses

    import families
    import torch

    setup = families.SETUPS[(args.family, args.preset)]
    if args.steps:
        setup = dataclasses.replace(setup, steps=args.steps)
    device = "cuda" if args.preset == "realistic" else "cpu"
    # only the text width is needed: a realistic pipeline is built on the meta device (no memory)
    pipeline = families.pipeline_of(setup, "meta" if device == "cuda" else "cpu", torch.bfloat16)
    requests = families.Requests(args.family, setup, families.hidden_size(pipeline),
                                 pooled_size=families.pooled_size(pipeline), embeds_dtype=args.embeds_dtype)
    del pipeline
    kernels = {"embeds_dtype": args.embeds_dtype}
    repositories = families.server_repositories(setup, device, tmp, kernels=kernels)
    options = setup.sized() | {"guidance_scale": setup.guidance, "num_inference_steps": setup.steps}

    def call(client: OmniClient, i: int) -> np.ndarray:
        pooled = {"pooled_prompt_embeds": requests.sent(requests.pooled(i))} if requests.pooled_size else {}
        return client.generate_image(prompt_embeds=requests.sent(requests.prompt(i)),
                                     negative_prompt_embeds=requests.sent(requests.negative(i)),
                                     seed=requests.seed(i), **pooled, **options)

    return repositories, ["diffusion"], ["diffusion"], call


def rotated(i: int) -> tuple[str, ...]:
    """The arms in turn i's order: who goes first rotates, so that drift hits each alike."""
    return ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]


def latencies(clients: dict[str, OmniClient], call: Call, requests: int) -> dict[str, list[float]]:
    measured: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(requests):
        for arm in rotated(i):
            start = time.perf_counter()
            call(clients[arm], i)
            measured[arm].append(time.perf_counter() - start)
    return measured


def throughputs(clients: dict[str, OmniClient], call: Call, concurrency: int, rounds: int) -> dict[str, float]:
    """Images/s of each arm: ``concurrency`` requests sent together, the median round."""
    measured: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(call, [clients["split"]] * concurrency, range(concurrency)))  # the batch sizes' warm-up
        for r in range(rounds):
            for arm in rotated(r):
                start = time.perf_counter()
                list(pool.map(call, [clients[arm]] * concurrency, range(concurrency)))
                measured[arm].append(time.perf_counter() - start)
    return {arm: concurrency / statistics.median(times) for arm, times in measured.items()}


def report(title: str, latency: dict[str, list[float]], throughput: dict[str, float], concurrency: int) -> None:
    p = {arm: (np.percentile(v, 50) * 1e3, np.percentile(v, 99) * 1e3) for arm, v in latency.items()}
    print(f"\n{title}: {len(latency['split'])} requests each at concurrency 1, "
          f"then rounds of {concurrency}")
    print(f"{'':<18}{'p50 ms':>10}{'p99 ms':>10}{'img/s':>10}")
    for arm in ARMS:
        print(f"{arm:<18}{p[arm][0]:>10.1f}{p[arm][1]:>10.1f}{throughput[arm]:>10.3f}")
    one, split, again = p["one server"], p["split"], p["one server again"]
    print(f"split / one server: p50 {split[0] / one[0]:.3f}, p99 {split[1] / one[1]:.3f}, "
          f"throughput {throughput['split'] / throughput['one server']:.3f}; the hop adds "
          f"{split[0] - one[0]:.1f} ms at p50")
    print(f"A/A (one server again / one server): p50 {again[0] / one[0]:.3f}, p99 {again[1] / one[1]:.3f}, "
          f"throughput {throughput['one server again'] / throughput['one server']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", help="diffusion with this family's embeddings (families.py's setups)")
    parser.add_argument("--preset", choices=["tiny", "realistic"], default="tiny")
    parser.add_argument("--requests", type=int, default=40, help="requests per arm at concurrency 1")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per arm at --concurrency")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the setup's; tiny route: 1)")
    parser.add_argument("--embeds-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="--family: the server's embeds_dtype, as the client sends them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="remote-stage-bench-") as tmp:
        logs = Path(tmp)
        repositories, load, forwarded, call = family_route(args, logs) if args.family else tiny_route(args)
        stage_port = free_port()

        def options(name: str, grpc_port: int, remote: list[str]) -> ServerOptions:
            return ServerOptions(http_port=free_port(), grpc_port=grpc_port, metrics_port=free_port(),
                                 model_control_mode="explicit", load_models=load, remote=remote,
                                 log_file=logs / f"{name}.log",
                                 **({"model_repositories": repositories} if repositories else {}))

        with TritonServer(options("stages", stage_port, [])) as stages, \
                TritonServer(options("front", free_port(),
                                     [f"{model}=127.0.0.1:{stage_port}" for model in forwarded])) as front:
            urls = {"one server": stages.grpc_url, "split": front.grpc_url, "one server again": stages.grpc_url}
            clients = {arm: OmniClient(url) for arm, url in urls.items()}
            first = {arm: call(client, 0) for arm, client in clients.items()}  # warm-up
            for arm in ARMS[1:]:
                assert np.array_equal(first[arm], first["one server"]), f"{arm}: not the one-server image"
            latency = latencies(clients, call, args.requests)
            throughput = throughputs(clients, call, args.concurrency, args.rounds)
        route = f"diffusion ({args.family} {args.preset})" if args.family else "text_to_image (tiny demo models)"
        report(f"{route}, {first['split'].shape[1]}x{first['split'].shape[0]}", latency, throughput,
               args.concurrency)


if __name__ == "__main__":
    main()
