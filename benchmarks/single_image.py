"""One user, one image, the demo default: `omni-triton generate-image` against
the diffusion runner called directly, unpadded.

What a new user sees first: `make serve`, then `omni-triton generate-image
"..." --out x.png`, which asks `diffusion` for one image at the model's
defaults (64x64, 20 steps, guidance 7.5 on the demo pipeline). The direct side
is the same pipeline and defaults in this process, one request, no padding
(request batching, `exact_batching` off): the least work the image takes.

The two sides alternate request by request, so noise hits both alike. Prints
p50/p99 of each and the ratio Triton/direct (the target: at most 1.2).

    .venv/bin/python benchmarks/single_image.py --requests 10
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
from triton_omni.demo_models import build_all
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni_client import OmniClient
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, PROJECT_ROOT, ServerOptions, TritonServer
from triton_omni_tools.repository import load_config

PROMPT = "a lighthouse on a cliff at dusk"


def direct_runner(device: str) -> DiffusionRunner:
    """The default repository's diffusion model, run whole and unpadded."""
    config = load_config(DEFAULT_REPOSITORIES[0] / "diffusion" / "config.pbtxt")
    params = {key: value.string_value for key, value in config.parameters.items()}
    return DiffusionRunner(DiffusionRunnerConfig(
        params["model"], device=device, batch_size=1, exact_batching=False, batching="request",
        defaults=json.loads(params["defaults"]), limits=json.loads(params["limits"])))


def measure(url: str, runner: DiffusionRunner, requests: int) -> dict[str, list[float]]:
    client = OmniClient(url)
    sides = {
        "triton": lambda: client.generate_image(PROMPT, seed=1),
        "direct": lambda: runner.run([runner.parse({"prompt": PROMPT, "seed": 1})])[0],
    }
    triton, direct = sides["triton"](), sides["direct"]().cpu().numpy()  # warm-up
    assert np.abs(triton.astype(int) - direct.astype(int)).max() <= 1, \
        "both sides must compute the same image"
    latencies: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(requests):
        for name in (list(sides) if i % 2 else list(sides)[::-1]):  # alternate who goes first
            start = time.perf_counter()
            sides[name]()
            latencies[name].append(time.perf_counter() - start)
    return latencies


def report(latencies: dict[str, list[float]]) -> dict:
    stats = {name: {"p50_ms": float(np.percentile(v, 50) * 1e3), "p99_ms": float(np.percentile(v, 99) * 1e3)}
             for name, v in latencies.items()}
    ratio = stats["triton"]["p50_ms"] / stats["direct"]["p50_ms"]
    print(f"\none generate-image at the demo defaults, {len(latencies['triton'])} requests per side, "
          f"{platform.processor() or platform.machine()}")
    for name, s in stats.items():
        print(f"  {name:<7} p50 {s['p50_ms']:8.1f} ms  p99 {s['p99_ms']:8.1f} ms")
    print(f"  triton/direct p50: {ratio:.2f}")
    return {"sides": stats, "ratio_p50": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    build_all()
    runner = direct_runner(args.device)
    log_file = PROJECT_ROOT / ".cache" / "bench-server.log"
    options = ServerOptions(http_port=18010, grpc_port=18011, metrics_port=18012, log_file=log_file,
                            model_control_mode="explicit", load_models=["diffusion"])
    with TritonServer(options) as server:
        stats = report(measure(server.grpc_url, runner, args.requests))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stats, f, indent=2)


if __name__ == "__main__":
    main()
