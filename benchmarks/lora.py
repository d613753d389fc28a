"""LoRA adapters per request, measured on the step engine (the diffusion runner in this process,
step batching): what serving different adapters in one batch costs, and what loading one costs.

* **throughput**: ``--concurrency`` requests submitted at once, each with a different adapter
  (ranks spread over ``--ranks``), against the same requests without one: images/s with over
  without (the issue's target: at least 0.85). Beside it, the host against itself: the requests
  without adapters measured twice (A/A), same rounds.
* **one adapter for all**: the same requests all with one adapter (a step-distillation adapter
  that every user runs), against none: with ``--fuse`` (``lora_fuse``) it runs fused into copies
  of the weights, and should cost nothing (the issue's target: at least 0.98).
* **first use**: one request whose adapter is not on the device yet (read from its file and
  copied in first), over the same request once it is: its extra latency.
* **loading under load**: requests without an adapter, ``--concurrency`` in flight, while
  adapters load one after another (one slot fewer than adapters, so each request with one
  loads it): their p99 latency over the same traffic without loads.

The adapters are random (rank r, the attention's linear layers of every block), written as
diffusers writes a trained one (``save_lora_weights``) and read back the way the server reads
them. Random weights make the images meaningless, not the time.

    .venv/bin/python benchmarks/lora.py                                   # CPU, the tiny Qwen-Image
    python benchmarks/lora.py --preset realistic --steps 10               # GPU: Qwen-Image 1024²
    python benchmarks/lora.py --preset realistic --steps 10 --fuse --compile
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig

SETUPS = {  # (model, size, guidance)
    ("qwen-image", "tiny"): ("demo:tiny-qwen-image", 32, 4.0),
    ("qwen-image", "realistic"): ("demo:realistic-qwen-image", 1024, 4.0),
    ("z-image", "tiny"): ("demo:tiny-z-image", 32, 4.0),
    ("z-image", "realistic"): ("demo:realistic-z-image", 1024, 0.0),
}
TOKENS = 64
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def shapes_of(model: str):
    """The pipeline ``model`` names, its weights on the meta device (shapes, no memory)."""
    from diffusers import DiffusionPipeline
    from triton_omni.demo_models import build_in_memory, in_memory, resolve_model

    if in_memory(model):
        return build_in_memory(model, "meta", torch.bfloat16)
    return DiffusionPipeline.from_pretrained(resolve_model(model))


def write_adapters(pipeline, folder: Path, ranks: list[int]) -> dict[str, str]:
    """One random adapter per rank, on every attention linear layer of the denoiser's blocks."""
    from peft import LoraConfig

    network = pipeline.transformer
    layers = {name: module for name, module in network.named_modules()
              if isinstance(module, torch.nn.Linear) and name.endswith(ATTENTION) and ".attn" in name}
    sources = {}
    for index, rank in enumerate(ranks):
        generator = torch.Generator().manual_seed(index)
        state = {}
        for name, layer in layers.items():
            for key, shape in (("lora_A", (rank, layer.in_features)), ("lora_B", (layer.out_features, rank))):
                state[f"{name}.{key}.weight"] = (torch.randn(shape, generator=generator) * 0.01).to(torch.bfloat16)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted({n.rsplit(".", 1)[-1] for n in layers}))
        path = folder / f"r{rank}-{index}"
        type(pipeline).save_lora_weights(path, transformer_lora_layers=state,
                                                transformer_lora_adapter_metadata=config.to_dict())
        sources[f"adapter{index}"] = str(path)
    return sources


def request(runner: DiffusionRunner, index: int, size: int, steps: int, guidance: float, lora: str | None):
    generator = torch.Generator().manual_seed(1000 + index)
    hidden = runner.limits.hidden_size
    values = {"prompt_embeds": torch.randn(TOKENS, hidden, generator=generator) * 0.5, "seed": 7 + index,
              "num_inference_steps": steps, "guidance_scale": guidance, "height": size, "width": size}
    if guidance > 0:
        values["negative_prompt_embeds"] = torch.randn(TOKENS * 3 // 4, hidden, generator=generator) * 0.5
    return runner.parse(values | ({"lora": lora} if lora else {}))


def burst(runner: DiffusionRunner, loras: list[str | None], size: int, steps: int, guidance: float) -> float:
    """Seconds for ``loras`` (one request each) submitted at once."""
    started = time.perf_counter()
    futures = [runner.submit(request(runner, i, size, steps, guidance, lora)) for i, lora in enumerate(loras)]
    for future in futures:
        future.result()
    return time.perf_counter() - started


def latencies_under(runner: DiffusionRunner, concurrency: int, seconds: float, size: int, steps: int,
                    guidance: float, meanwhile=None) -> list[float]:
    """Latencies of requests without an adapter, ``concurrency`` in flight for ``seconds``;
    ``meanwhile()`` runs beside them (the loads)."""
    stop = time.perf_counter() + seconds
    found: list[float] = []

    def worker(index: int) -> None:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            runner.submit(request(runner, index, size, steps, guidance, None)).result()
            found.append(time.perf_counter() - started)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    if meanwhile is not None:
        meanwhile(stop)
    for thread in threads:
        thread.join()
    return found


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted({family for family, _ in SETUPS}), default="qwen-image")
    parser.add_argument("--preset", choices=["tiny", "realistic"], default="tiny")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--ranks", default="16,64", help="the adapters' ranks, spread from the first to the last")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--load-seconds", type=float, default=0,
                        help="each window of the loading-under-load measure (0: 12 steps alone per request)")
    parser.add_argument("--compile", action="store_true", help="compile: blocks (and count the graphs)")
    parser.add_argument("--fuse", action="store_true", help="lora_fuse: a shared adapter runs fused")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    model, size, guidance = SETUPS[(args.family, args.preset)]
    cuda = args.preset == "realistic"
    low, high = (int(r) for r in args.ranks.split(","))
    count = args.concurrency
    ranks = [low + (high - low) * i // max(1, count - 1) for i in range(count)] + [low, high]  # two kept fresh
    folder = Path(tempfile.mkdtemp(prefix="omni-lora-"))
    config = dict(device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32", batching="step",
                  batch_size=count, exact_batching=False, limits={"max_size": max(1024, size)},
                  compile="blocks" if args.compile else "off", lora_fuse=args.fuse)
    sources = write_adapters(shapes_of(model), folder, ranks)
    runner = DiffusionRunner(DiffusionRunnerConfig(model, lora_adapters=sources, max_loras=count + 1, **config))
    names = list(sources)
    every, fresh = names[:count], names[count:]
    try:
        # warm-up: the adapters loaded, kernels chosen (and compiled, for each batch size to come)
        shared_loras = every[:1] * count
        for loras in (every, shared_loras, [None] * count, [None] * (count - 1), every[:1], [None]):
            burst(runner, loras, size, 2, guidance)
        plain, again, adapted, shared = [], [], [], []
        for _ in range(args.rounds):
            plain.append(count / burst(runner, [None] * count, size, args.steps, guidance))
            adapted.append(count / burst(runner, every, size, args.steps, guidance))
            shared.append(count / burst(runner, shared_loras, size, args.steps, guidance))
            again.append(count / burst(runner, [None] * count, size, args.steps, guidance))
        graphs = compiled_graphs()
        first = burst(runner, [fresh[0]], size, args.steps, guidance)  # read, copied in, run
        loaded = burst(runner, [fresh[0]], size, args.steps, guidance)
        started = time.perf_counter()  # a load alone: read from its file, moved to the device, copied into a slot
        runner.adapters.release(runner.adapters.acquire(fresh[1]).result())
        load_s = time.perf_counter() - started
        step = loaded / args.steps
        seconds = args.load_seconds or 12 * step * count

        def loads(stop: float) -> None:  # each adapter in turn, each evicting another: a load every request
            turn = 0
            while time.perf_counter() < stop:
                burst(runner, [names[turn % len(names)]], size, 1, guidance)
                turn += 1

        quiet = latencies_under(runner, count - 1, seconds, size, args.steps, guidance)
        busy = latencies_under(runner, count - 1, seconds, size, args.steps, guidance, loads)
        loads_done = sum(n for (event, _), n in runner.adapters.counts.items() if event == "load")
        graphs = compiled_graphs() - graphs
    finally:
        runner.close()
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    result = {
        "family": args.family, "preset": args.preset, "device": device, "size": size, "steps": args.steps,
        "concurrency": count, "ranks": ranks[:count], "compile": args.compile, "fuse": args.fuse,
        "images_per_s": {"plain": plain, "adapters": adapted, "shared": shared, "plain_again": again},
        "throughput_ratio": statistics.median(a / p for a, p in zip(adapted, plain, strict=True)),
        "shared_ratio": statistics.median(a / p for a, p in zip(shared, plain, strict=True)),
        "aa_ratio": statistics.median(a / p for a, p in zip(again, plain, strict=True)),
        "first_use_s": first, "resident_s": loaded, "first_use_extra_s": first - loaded, "load_s": load_s,
        "graphs_after_warm_up": graphs if args.compile else None,
        "p99_quiet_s": p99(quiet), "p99_loading_s": p99(busy), "p99_ratio": p99(busy) / p99(quiet),
        "loads": loads_done, "date": time.strftime("%Y-%m-%d")}
    print(f"LoRA per request: {args.family} ({args.preset}: {size}², {args.steps} steps, guidance {guidance}) on "
          f"{device}, {count} requests at once, ranks {ranks[:count]}{', compile: blocks' if args.compile else ''}")
    print(f"  images/s, {count} adapters over none: {result['throughput_ratio']:.3f}  (A/A, none over none: "
          f"{result['aa_ratio']:.3f}; rounds {[round(a / p, 3) for a, p in zip(adapted, plain, strict=True)]})")
    print(f"  images/s, one adapter (rank {ranks[0]}) for all over none{' (lora_fuse)' if args.fuse else ''}: "
          f"{result['shared_ratio']:.3f}  (rounds {[round(a / p, 3) for a, p in zip(shared, plain, strict=True)]})")
    print(f"  first use of an adapter: {first:.3f} s against {loaded:.3f} s resident ({first - loaded:+.3f} s); "
          f"a load alone (read, to the device, into a slot): {load_s:.3f} s")
    print(f"  p99 of requests without one while adapters load: {result['p99_loading_s']:.3f} s against "
          f"{result['p99_quiet_s']:.3f} s quiet ({result['p99_ratio']:.3f}; {len(busy)} and {len(quiet)} "
          f"requests, {loads_done} loads in all)")
    if args.compile:
        print(f"  graphs compiled after the warm-up, through every mix of adapters and the loads: {graphs}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
