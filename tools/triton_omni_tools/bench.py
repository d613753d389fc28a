"""``omni-triton bench``: each stage and pipeline, run directly through the
runner library and through Triton, side by side in one run.

For every workload and concurrency c:
- direct: the runner library in this process; c requests at a time, as one
  batch (diffusion, encoder) or c concurrent generations (AR). This is the
  raw engine curve;
- eager (diffusion on CUDA): the same direct run with the UNet's CUDA graphs
  off, i.e. plain diffusers;
- triton: c client processes in a closed loop against a server this command
  starts, with the same models and configs.

It prints a table (throughput, p50/p99 latency, Triton/direct throughput
ratio), and writes JSON and a PNG plot. Presets:
- ``tiny``: the demo models on CPU, a few minutes;
- ``realistic``: random weights at real sizes on a GPU (an SD1.5-size UNet
  and VAE at 512x512, 20 steps; a Qwen2.5-0.5B-size AR model). The direct
  phase runs first and frees its models before the server starts, so the
  two never share the GPU.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = "a lighthouse on a cliff at dusk, oil painting"


@dataclass(frozen=True)
class Preset:
    ar_model: str
    diffusion_model: str
    size: int
    steps: int
    guidance: float
    max_tokens: int
    max_batch_size: int  # of diffusion and ar_encoder
    requests_per_worker: int  # Triton side; the direct side runs the same number of requests
    # Exact batching pads every diffusion call to max_batch_size (docs/models.md): free at full
    # concurrency, up to max_batch_size times the work below it. `realistic` measures without it,
    # as the raw diffusers curve does.
    exact_batching: bool = True
    # How long diffusion's batcher waits for a fuller batch. The default repository's 20 ms is
    # short next to a 2 s batch: 16 closed-loop clients re-sending after a batch then miss it,
    # and the batches split for good (15 + 1, ...). 100 ms is 5% of such a batch.
    diffusion_queue_delay_us: int = 20_000
    workloads: tuple[str, ...] = ("diffusion", "ar_encoder", "ar", "text_to_image", "omni")
    concurrency: tuple[int, ...] = (1, 4, 8, 16)


PRESETS = {
    "tiny": Preset("demo:tiny-qwen2", "demo:tiny-sd", size=32, steps=2, guidance=1.0, max_tokens=16,
                   max_batch_size=8, requests_per_worker=2),
    "realistic": Preset("demo:realistic-qwen2", "demo:realistic-sd", size=512, steps=20, guidance=7.5,
                        max_tokens=32, max_batch_size=16, requests_per_worker=2, exact_batching=False,
                        diffusion_queue_delay_us=100_000),
}


@dataclass
class Point:
    workload: str
    concurrency: int
    side: str  # direct | triton
    requests: int
    seconds: float
    latencies_s: list[float] = field(repr=False)
    mean_batch: float | None = None  # Triton side: mean executed batch size of the batching stage
    server: dict[str, float] | None = None  # Triton side: its own statistics of that stage

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies_s)
        return {"workload": self.workload, "concurrency": self.concurrency, "side": self.side,
                "requests": self.requests, "throughput_per_s": self.throughput,
                "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
                "mean_batch": self.mean_batch, "server": self.server}


# -- direct: the runner library in this process ---------------------------------


class Direct:
    def __init__(self, preset: Preset, device: str):
        from triton_omni.ar import ArRunner, ArRunnerConfig
        from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig

        self.preset = preset
        needs = set(preset.workloads)
        self.generator = ArRunner(ArRunnerConfig(preset.ar_model, "generate", device=device)) \
            if "ar" in needs else None
        # every workload but `ar` needs embeddings (diffusion takes one precomputed prompt's)
        self.encoder = ArRunner(ArRunnerConfig(preset.ar_model, "encode", device=device)) \
            if needs - {"ar"} else None
        diffusion_config = DiffusionRunnerConfig(preset.diffusion_model, device=device,
                                                 batch_size=preset.max_batch_size,
                                                 exact_batching=preset.exact_batching,
                                                 limits={"max_size": max(1024, preset.size)})
        self.diffusion = DiffusionRunner(diffusion_config) if needs - {"ar", "ar_encoder"} else None
        self.embeds = self._encode(1)[0] if self.encoder else None

    def _encode(self, n: int) -> list:
        from triton_omni.ar import EncodeRequest

        results = self.encoder.loop.run(self.encoder.encode([EncodeRequest(PROMPT)] * n))
        return [r.hidden_states for r in results]

    def _diffuse(self, embeds: list) -> None:
        p = self.preset
        requests = [self.diffusion.parse({"prompt_embeds": e, "num_inference_steps": p.steps, "seed": i,
                                          "guidance_scale": p.guidance, "height": p.size, "width": p.size})
                    for i, e in enumerate(embeds)]
        self.diffusion.run(requests)

    def _generate(self, n: int) -> None:
        from triton_omni.ar import GenerateRequest

        request = GenerateRequest.from_inputs({"text_input": PROMPT, "sampling_parameters": json.dumps(
            {"max_tokens": self.preset.max_tokens, "ignore_eos": True})}, self.generator.config.limits)

        async def one():
            async for _ in self.generator.generate(request, uuid.uuid4().hex):
                pass

        async def all_of_them():
            await asyncio.gather(*(one() for _ in range(n)))

        self.generator.loop.run(all_of_them())

    def call(self, workload: str) -> Callable[[int], None]:
        return {
            "diffusion": lambda c: self._diffuse([self.embeds] * c),
            "ar_encoder": lambda c: self._encode(c),
            "ar": self._generate,
            "text_to_image": lambda c: self._diffuse(self._encode(c)),
            "omni": lambda c: self._diffuse(self._encode(c)),
        }[workload]

    def close(self) -> None:
        for runner in (self.generator, self.encoder):
            if runner is not None:
                runner.close()
        self.diffusion = None
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure_direct(direct: Direct, workload: str, concurrency: int, requests: int, side: str = "direct") -> Point:
    call = direct.call(workload)
    call(concurrency)  # warm-up (and, on CUDA, kernel selection)
    rounds = max(1, requests // concurrency)
    latencies, start = [], time.perf_counter()
    for _ in range(rounds):
        t0 = time.perf_counter()
        call(concurrency)
        latencies += [time.perf_counter() - t0] * concurrency
    return Point(workload, concurrency, side, rounds * concurrency, time.perf_counter() - start, latencies)


def measure_eager(direct: Direct, concurrency: int, requests: int) -> Point:
    """Diffusion direct with the UNet's CUDA graphs off: plain eager
    diffusers, the raw curve, measured in the same run as the rest."""
    direct.diffusion.graphs.enabled = False
    try:
        return measure_direct(direct, "diffusion", concurrency, requests, side="eager")
    finally:
        direct.diffusion.graphs.enabled = True


# -- triton: the same work through the server -------------------------------------


def triton_call(workload: str, url: str, preset: Preset, embeds: np.ndarray) -> Callable[[], None]:
    import tritonclient.grpc as grpcclient
    from triton_omni_client.client import batched_inputs, omni_inputs, stream_infer

    image_options = {"num_inference_steps": preset.steps, "guidance_scale": preset.guidance,
                     "height": preset.size, "width": preset.size, "seed": 1}
    client = grpcclient.InferenceServerClient(url)

    def check(result, name: str) -> None:
        if result.as_numpy(name) is None:
            raise RuntimeError(f"{workload}: no {name} in the response")

    def diffusion():
        check(client.infer("diffusion", batched_inputs(grpcclient, prompt_embeds=embeds, **image_options)), "image")

    def ar_encoder():
        check(client.infer("ar_encoder", batched_inputs(grpcclient, text_input=PROMPT)), "prompt_embeds")

    def ar():
        values = {"text_input": PROMPT, "sampling_parameters": json.dumps(
            {"max_tokens": preset.max_tokens, "ignore_eos": True})}
        list(stream_infer(url, "ar", omni_inputs(grpcclient, values)))

    def text_to_image():
        inputs = batched_inputs(grpcclient, text_input=PROMPT, negative_prompt="", **image_options)
        check(client.infer("text_to_image", inputs), "image")

    def omni():
        values = {"text_input": PROMPT, "modalities": ["image"], "stream": False, **image_options}
        [result] = list(stream_infer(url, "omni", omni_inputs(grpcclient, values)))
        check(result, "image")

    return locals()[workload]


def measure_triton(url: str, preset: Preset, embeds: np.ndarray, workload: str, concurrency: int,
                   metrics_url: str) -> Point:
    """``concurrency`` client *processes* in a closed loop: threads in one
    process would serialise on the GIL (decoding images, building requests)
    and make the load generator the bottleneck, not the server."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready, results, warm, go = context.Queue(), context.Queue(), context.Event(), context.Event()
    workers = [context.Process(target=_client_process,
                               args=(url, preset, embeds, workload, ready, warm, go, results))
               for _ in range(concurrency)]
    for worker in workers:
        worker.start()
    for _ in workers:  # connected: warm up together
        ready.get()
    warm.set()
    for _ in workers:  # warmed up
        ready.get()
    batches_before, stats_before = _batch_counts(metrics_url, workload), _server_stats(url, workload)
    start = time.time()
    go.set()
    outcomes = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    errors = [error for _, _, error in outcomes if error]
    if errors:
        raise RuntimeError(f"{len(errors)} {workload} client(s) failed; first: {errors[0]}")
    latencies = [latency for lat, _, _ in outcomes for latency in lat]
    point = Point(workload, concurrency, "triton", len(latencies), max(end for _, end, _ in outcomes) - start,
                  latencies)
    point.mean_batch = _mean_batch(batches_before, _batch_counts(metrics_url, workload))
    point.server = _stats_delta(stats_before, _server_stats(url, workload))
    return point


def _batching_model(workload: str) -> str:
    return "ar_encoder" if workload == "ar_encoder" else "ar" if workload == "ar" else "diffusion"


def _server_stats(url: str, workload: str) -> dict[str, float]:
    """Triton's own cumulative statistics of the stage a workload batches on."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics(_batching_model(workload), as_json=True)["model_stats"][0]
    inference = stats["inference_stats"]
    values = {name: float(inference[name].get("ns", 0)) for name in
              ("queue", "compute_input", "compute_infer", "compute_output")}
    values["executions"] = float(stats.get("execution_count", 0))
    values["requests"] = float(inference["success"].get("count", 0))
    return values


def _stats_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per request, in ms (Triton counts a batch's compute time once for each of its requests)."""
    requests = max(1.0, after["requests"] - before["requests"])
    return {f"{name}_ms": (after[name] - before[name]) / requests / 1e6
            for name in ("queue", "compute_input", "compute_infer", "compute_output")}


def _client_process(url, preset, embeds, workload, ready, warm, go, results) -> None:
    latencies, error = [], None
    call = triton_call(workload, url, preset, embeds)
    ready.put(True)
    warm.wait()
    # Warm-up, all clients at once: the server meets the measured batch size (its
    # kernel selection and CUDA graph capture) before the clock starts.
    call()
    ready.put(True)
    go.wait()
    for _ in range(preset.requests_per_worker):
        t0 = time.time()
        try:
            call()
        except Exception as exc:  # sent back to the parent, which raises it
            error = f"{type(exc).__name__}: {exc}"
            break
        latencies.append(time.time() - t0)
    results.put((latencies, time.time(), error))


def _batch_counts(metrics_url: str, workload: str) -> tuple[float, float]:
    """(sum, count) of the executed batch-size histogram of the stage a workload batches on."""
    import re
    import urllib.request

    family, model = ("omni_ar_batch_size", "ar_encoder") if workload == "ar_encoder" else \
        ("omni_diffusion_batch_size", "diffusion")
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    values = []
    for suffix in ("sum", "count"):
        found = re.search(rf'^{family}_{suffix}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, flags=re.M)
        values.append(float(found.group(1)) if found else 0.0)
    return values[0], values[1]


def _mean_batch(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count else None


MODELS = {
    "diffusion": ["diffusion"],
    "ar_encoder": ["ar_encoder"],
    "ar": ["ar"],
    "text_to_image": ["ar_encoder", "diffusion", "text_to_image"],
    "omni": ["ar", "ar_encoder", "diffusion", "omni"],
}


def models_for(workloads: tuple[str, ...]) -> list[str]:
    """Only the models the workloads use are loaded (each holds GPU memory and a process)."""
    return sorted({model for workload in workloads for model in MODELS[workload]})


def bench_repository(preset: Preset, dest: Path) -> list[Path]:
    """Copies of the default repositories with the preset's models and batch size."""
    from triton_omni_tools.launcher import DEFAULT_REPOSITORIES
    from triton_omni_tools.repository import copy_repositories

    ar = {"model": preset.ar_model}
    return copy_repositories(DEFAULT_REPOSITORIES, dest, {
        "ar": {"parameters": ar},
        "ar_encoder": {"parameters": ar, "max_batch_size": preset.max_batch_size},
        "diffusion": {
            "parameters": {"model": preset.diffusion_model, "limits": {"max_size": max(1024, preset.size)},
                           "exact_batching": str(preset.exact_batching).lower()},
            "max_batch_size": preset.max_batch_size,
            "max_queue_delay_us": preset.diffusion_queue_delay_us,
        },
    })


# -- the run -------------------------------------------------------------------------


def run(preset_name: str, concurrency: tuple[int, ...] | None, workloads: tuple[str, ...] | None,
        out_dir: Path) -> list[dict]:
    import torch
    from triton_omni.demo_models import resolve_model

    from triton_omni_tools.launcher import ServerOptions, TritonServer

    preset = PRESETS[preset_name]
    preset = Preset(**(asdict(preset) | {k: v for k, v in (("concurrency", concurrency), ("workloads", workloads))
                                          if v}))
    resolve_model(preset.ar_model), resolve_model(preset.diffusion_model)  # build demo models before timing
    device = "cuda" if torch.cuda.is_available() else "cpu"
    points: list[Point] = []
    out_dir.mkdir(parents=True, exist_ok=True)

    def record(point: Point) -> None:
        """Keep every point on disk as it comes: a run cut short still leaves its figures."""
        points.append(point)
        _progress(point)
        (out_dir / "points.json").write_text(json.dumps([p.summary() for p in points], indent=2))

    print(f"== direct ({device})", flush=True)
    direct = Direct(preset, device)
    embeds = direct.embeds.float().cpu().numpy() if direct.embeds is not None else None
    for workload in preset.workloads:
        for c in preset.concurrency:
            record(measure_direct(direct, workload, c, c * preset.requests_per_worker))
            if workload == "diffusion" and direct.diffusion.graphs is not None:
                record(measure_eager(direct, c, c * preset.requests_per_worker))
    direct.close()
    del direct

    print("== triton", flush=True)
    with tempfile.TemporaryDirectory(prefix="omni-bench-") as tmp:
        options = ServerOptions(model_repositories=bench_repository(preset, Path(tmp)), http_port=18100,
                                grpc_port=18101, metrics_port=18102, log_file=out_dir / "server.log",
                                model_control_mode="explicit", load_models=models_for(preset.workloads))
        with TritonServer(options) as server:
            for workload in preset.workloads:
                for c in preset.concurrency:
                    record(measure_triton(server.grpc_url, preset, embeds, workload, c, server.metrics_url))

    rows = table(points)
    (out_dir / "bench.json").write_text(json.dumps(
        {"preset": asdict(preset), "device": _device_name(), "rows": rows,
         "points": [p.summary() for p in points]}, indent=2))
    plot(rows, out_dir / "bench.png", f"omni-triton bench --preset {preset_name} ({_device_name()})")
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")
    return rows


def _progress(point: Point) -> None:
    s = point.summary()
    batch = f"  mean batch {s['mean_batch']:.1f}" if s["mean_batch"] else ""
    if s["server"]:
        server = s["server"]
        batch += "  [server ms: " + ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in server.items()) + "]"
    print(f"  {s['workload']:<14} c={s['concurrency']:<3} {s['side']:<7} {s['throughput_per_s']:8.2f}/s  "
          f"p50 {s['p50_ms']:8.1f} ms  p99 {s['p99_ms']:8.1f} ms{batch}", flush=True)


def table(points: list[Point]) -> list[dict]:
    by_key = {(p.workload, p.concurrency, p.side): p.summary() for p in points}
    rows = []
    header = (f"{'workload':<14}{'conc':>5}{'direct/s':>10}{'triton/s':>10}{'ratio':>7}"
              f"{'direct p50':>12}{'triton p50':>12}{'direct p99':>12}{'triton p99':>12}")
    print("\n" + header + "\n" + "-" * len(header))
    for (workload, c, side), d in by_key.items():
        t = by_key.get((workload, c, "triton"))
        if side != "direct" or t is None:
            continue
        row = {"workload": workload, "concurrency": c, "direct_per_s": d["throughput_per_s"],
               "triton_per_s": t["throughput_per_s"], "ratio": t["throughput_per_s"] / d["throughput_per_s"],
               "direct_p50_ms": d["p50_ms"], "triton_p50_ms": t["p50_ms"],
               "direct_p99_ms": d["p99_ms"], "triton_p99_ms": t["p99_ms"]}
        eager = by_key.get((workload, c, "eager"))
        if eager is not None:
            row |= {"eager_per_s": eager["throughput_per_s"],
                    "ratio_to_eager": t["throughput_per_s"] / eager["throughput_per_s"]}
        rows.append(row)
        print(f"{workload:<14}{c:>5}{row['direct_per_s']:>10.2f}{row['triton_per_s']:>10.2f}{row['ratio']:>7.2f}"
              f"{row['direct_p50_ms']:>12.1f}{row['triton_p50_ms']:>12.1f}{row['direct_p99_ms']:>12.1f}"
              f"{row['triton_p99_ms']:>12.1f}")
    eager_rows = [r for r in rows if "eager_per_s" in r]
    if eager_rows:
        print("\ndiffusion against the eager (raw diffusers) curve, measured in the same run:")
        for r in eager_rows:
            print(f"  c={r['concurrency']:<3} eager {r['eager_per_s']:.2f}/s  direct (CUDA graphs) "
                  f"{r['direct_per_s']:.2f}/s  triton {r['triton_per_s']:.2f}/s  "
                  f"triton/eager {r['ratio_to_eager']:.2f}")
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Throughput against concurrency, one panel per workload: direct dashed, Triton solid (PIL only)."""
    from PIL import Image, ImageDraw

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    panel_w, panel_h, margin = 360, 260, 50
    image = Image.new("RGB", (panel_w * len(workloads), panel_h + 40), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 8), title, fill="black")
    for k, workload in enumerate(workloads):
        data = [r for r in rows if r["workload"] == workload]
        x0, y0 = k * panel_w + margin, 40 + 20
        w, h = panel_w - margin - 20, panel_h - 60
        top = max(max(r["direct_per_s"], r["triton_per_s"], r.get("eager_per_s", 0)) for r in data) * 1.1
        concurrencies = [r["concurrency"] for r in data]

        def xy(i: int, value: float) -> tuple[float, float]:
            return (x0 + w * i / max(1, len(data) - 1), y0 + h - h * value / top)  # noqa: B023

        draw.rectangle([x0, y0, x0 + w, y0 + h], outline="gray")
        draw.text((x0, y0 - 16), f"{workload} (per s)", fill="black")
        draw.text((x0 - 45, y0), f"{top:.1f}", fill="gray")
        for i, c in enumerate(concurrencies):
            draw.text((xy(i, 0)[0] - 4, y0 + h + 4), str(c), fill="gray")
        for key, colour, dashed in (("eager_per_s", "#3b6fd4", True), ("direct_per_s", "gray", True),
                                    ("triton_per_s", "#76b900", False)):
            if any(key not in r for r in data):
                continue
            points = [xy(i, r[key]) for i, r in enumerate(data)]
            for a, b in itertools.pairwise(points):
                if dashed:
                    for t in np.linspace(0, 1, 12)[::2]:
                        s = min(1, t + 1 / 11)
                        draw.line([(a[0] + (b[0] - a[0]) * t, a[1] + (b[1] - a[1]) * t),
                                   (a[0] + (b[0] - a[0]) * s, a[1] + (b[1] - a[1]) * s)], fill=colour, width=2)
                else:
                    draw.line([a, b], fill=colour, width=3)
            for p in points:
                draw.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=colour)
        draw.text((x0 + 4, y0 + h + 18), "concurrency; dashed: direct (blue: eager), green: Triton", fill="gray")
    image.save(path)


def _device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.machine()}, {__import__('os').cpu_count()} cores"

