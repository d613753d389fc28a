"""The bench harness: the direct side (the runner library in this process),
the Triton side (client processes against a server it starts), and the run
that measures both and hands the points to the report."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from triton_omni_tools.bench.presets import BATCH_SIZE_METRICS, PRESETS, PROMPT, WORKLOADS, Preset, models_for
from triton_omni_tools.bench.report import device_name, plot, progress, table


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

    calls = {"diffusion": diffusion, "ar_encoder": ar_encoder, "ar": ar, "text_to_image": text_to_image,
             "omni": omni}
    return calls[workload]


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


def _server_stats(url: str, workload: str) -> dict[str, float]:
    """Triton's own cumulative statistics of the stage a workload batches on."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics(WORKLOADS[workload].batches_on, as_json=True)["model_stats"][0]
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

    model = WORKLOADS[workload].batches_on
    family = BATCH_SIZE_METRICS.get(model)
    if family is None:  # a decoupled model: no executed batches to count
        return 0.0, 0.0
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    values = []
    for suffix in ("sum", "count"):
        found = re.search(rf'^{family}_{suffix}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, flags=re.M)
        values.append(float(found.group(1)) if found else 0.0)
    return values[0], values[1]


def _mean_batch(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count else None


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
        progress(point)
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
        {"preset": asdict(preset), "device": device_name(), "rows": rows,
         "points": [p.summary() for p in points]}, indent=2))
    plot(rows, out_dir / "bench.png", f"omni-triton bench --preset {preset_name} ({device_name()})")
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")
    return rows


