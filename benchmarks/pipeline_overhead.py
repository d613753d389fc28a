"""Per-hop overhead of the two pipelines against calling the stages directly.

One server, one run, the same work three ways, interleaved request by request
so that noise hits all three alike:

* direct:   the client calls ar_encoder, then diffusion with the embeddings
            (two round trips; the embeddings travel to the client and back);
* ensemble: one call to text_to_image (Triton moves the embeddings);
* bls:      one call to omni, image route, non-streaming (Python moves them).

Prints p50/p99 latency of each and the ratios to direct. Tiny demo models on
CPU: the stages themselves take little time, so the overhead is what shows.

    make bench-pipelines    (or: .venv/bin/python benchmarks/pipeline_overhead.py --requests 60)
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import tritonclient.grpc as grpcclient
from triton_omni.demo_models import build_all
from triton_omni_client.client import batched_inputs, omni_inputs, stream_infer
from triton_omni_tools.launcher import PROJECT_ROOT, ServerOptions, TritonServer

PROMPT = "a lighthouse on a cliff at dusk"


def direct(client, url: str, options: dict) -> np.ndarray:
    """ar_encoder (the prompt and its negative side, as the ensemble asks for both), then diffusion."""
    names = ("prompt_embeds", "negative_prompt_embeds")
    encoded = client.infer("ar_encoder", batched_inputs(grpcclient, text_input=PROMPT),
                           outputs=[grpcclient.InferRequestedOutput(name) for name in names])
    embeds, negative = (encoded.as_numpy(name)[0] for name in names)
    image = client.infer("diffusion", batched_inputs(grpcclient, prompt_embeds=embeds, negative_prompt_embeds=negative,
                                                     **options))
    return image.as_numpy("image")[0]


def ensemble(client, url: str, options: dict) -> np.ndarray:
    inputs = batched_inputs(grpcclient, text_input=PROMPT, **options)
    return client.infer("text_to_image", inputs).as_numpy("image")[0]


def bls(client, url: str, options: dict) -> np.ndarray:
    values = {"text_input": PROMPT, "modalities": ["image"], "stream": False, **options}
    [result] = list(stream_infer(url, "omni", omni_inputs(grpcclient, values)))
    return result.as_numpy("image")[0]


PATHS = {"direct": direct, "ensemble": ensemble, "bls": bls}


def measure(url: str, requests: int, options: dict) -> dict[str, list[float]]:
    latencies: dict[str, list[float]] = {name: [] for name in PATHS}
    with grpcclient.InferenceServerClient(url) as client:
        reference = {name: call(client, url, options) for name, call in PATHS.items()}  # warm-up
        assert all(np.array_equal(reference["direct"], image) for image in reference.values()), \
            "the three paths must compute the same image"
        order = list(PATHS)
        for i in range(requests):
            for name in order[i % 3:] + order[: i % 3]:  # rotate who goes first
                start = time.perf_counter()
                PATHS[name](client, url, options)
                latencies[name].append(time.perf_counter() - start)
    return latencies


def report(latencies: dict[str, list[float]], options: dict) -> dict:
    stats = {name: {"p50_ms": float(np.percentile(v, 50) * 1e3), "p99_ms": float(np.percentile(v, 99) * 1e3)}
             for name, v in latencies.items()}
    base = stats["direct"]
    print(f"\ntext -> ar_encoder -> diffusion ({options['num_inference_steps']} steps, "
          f"{options['height']}x{options['width']}), {len(latencies['direct'])} requests per path, "
          f"concurrency 1, {platform.processor() or platform.machine()}")
    print(f"{'path':<10}{'p50 ms':>10}{'p99 ms':>10}{'p50/direct':>12}{'p99/direct':>12}{'p50 overhead ms':>17}")
    for name, s in stats.items():
        s["p50_ratio"] = s["p50_ms"] / base["p50_ms"]
        s["p99_ratio"] = s["p99_ms"] / base["p99_ms"]
        s["p50_overhead_ms"] = s["p50_ms"] - base["p50_ms"]
        print(f"{name:<10}{s['p50_ms']:>10.1f}{s['p99_ms']:>10.1f}{s['p50_ratio']:>12.2f}{s['p99_ratio']:>12.2f}"
              f"{s['p50_overhead_ms']:>17.1f}")
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    # Small work per stage by default, so that the overhead is not lost in noise.
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--guidance", type=float, default=1.0, help="<= 1: no classifier-free guidance")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    options = {"num_inference_steps": args.steps, "height": args.size, "width": args.size, "seed": 1,
               "guidance_scale": args.guidance}
    build_all()
    log_file = PROJECT_ROOT / ".cache" / "bench-server.log"
    with TritonServer(ServerOptions(http_port=18000, grpc_port=18001, metrics_port=18002, log_file=log_file)) as server:
        stats = report(measure(server.grpc_url, args.requests, options), options)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": options, "requests": args.requests, "stats": stats}, f, indent=2)


if __name__ == "__main__":
    main()
