"""The bench harness: the direct side (the runner library in this process),
the Triton side (client processes against a server it starts), and the run
that measures both and hands the points to the report."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from triton_omni_tools.bench.cpu import CpuWindow, engine_cores
from triton_omni_tools.bench.presets import (
    AR_WORKLOADS,
    BATCH_SIZE_METRICS,
    GENERATION_WORKLOADS,
    PRESETS,
    PROMPT,
    WORKLOADS,
    Preset,
    models_for,
)
from triton_omni_tools.bench.report import device_name, plot, progress, table


def generation_options(max_tokens: int) -> dict:
    """A bench generation request's sampling options: exactly ``max_tokens`` tokens, on both sides."""
    return {"max_tokens": max_tokens, "ignore_eos": True}


class ClientLengths:
    """Each client's next output length (``Preset.output_lengths``), by client index."""

    def __init__(self, preset: Preset):
        self.preset, self.lengths = preset, {}

    def next(self, client: int) -> int:
        if client not in self.lengths:
            self.lengths[client] = self.preset.output_lengths(client)
        return next(self.lengths[client])


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
    streams: list[Stream] | None = None  # text generation: each request's token timeline
    counters: dict[str, float] | None = None  # Triton side, image workloads: diffusion's counters in the window
    # Triton side: the cores each model's stub process kept busy in the window (its CPU seconds over the
    # window's): near 1.0, a stub's Python thread (the GIL) is what limits it.
    stub_cores: dict[str, float] | None = None
    turn: int = 0  # which of the point's direct/triton pairs this is (run(): pairs)
    # AR stages: cores busy in the window (bench/cpu.py): the host, the engine cores, tritonserver itself
    cores: dict[str, float] | None = None

    @property
    def throughput(self) -> float:
        """Output tokens/s for text generation, requests/s otherwise."""
        if self.streams is not None:
            return sum(s.tokens for s in self.streams) / self.seconds
        return self.requests / self.seconds

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies_s)
        summary = {"workload": self.workload, "concurrency": self.concurrency, "side": self.side,
                   "requests": self.requests, "throughput_per_s": self.throughput,
                   "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
                   "mean_batch": self.mean_batch, "server": self.server, "counters": self.counters,
                   "stub_cores": self.stub_cores, "cores": self.cores, "turn": self.turn}
        if self.streams is not None:
            ttft = np.array([s.ttft_s for s in self.streams]) * 1e3
            itl = np.array([gap for s in self.streams for gap in s.itl_s] or [0.0]) * 1e3
            summary |= {"unit": "tokens", "tokens": sum(s.tokens for s in self.streams),
                        "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
                        "itl_p50_ms": float(np.percentile(itl, 50)), "itl_p99_ms": float(np.percentile(itl, 99))}
        return summary


@dataclass
class Stream:
    """One streamed generation: time to first token, the inter-token gaps, tokens."""

    ttft_s: float
    itl_s: list[float]
    tokens: int
    latency_s: float

    @classmethod
    def from_marks(cls, start: float, marks: list[tuple[float, int]]) -> Stream:
        """``marks``: (arrival time, new tokens) of each response. A response
        carrying k tokens after a gap g counts as k gaps of g / k (vLLM's own
        benchmark does the same)."""
        marks = [m for m in marks if m[1] > 0] or marks
        itl = []
        for (before, _), (at, tokens) in itertools.pairwise(marks):
            itl += [(at - before) / tokens] * tokens
        return cls(marks[0][0] - start, itl, sum(n for _, n in marks), marks[-1][0] - start)


# -- direct: the runner library in this process ---------------------------------

TRANSFORMERS_SHARE = "0.15"  # ar_transformers' share of the GPU (the bench adds that model)


def gpu_share(model: str) -> float | None:
    """A model's gpu_memory_utilization in the default repository (the bench's own for ar_transformers)."""
    from triton_omni_tools.launcher import DEFAULT_REPOSITORIES
    from triton_omni_tools.memory_plan import configured_share
    from triton_omni_tools.repository import load_config

    if model == "ar_transformers":
        return float(TRANSFORMERS_SHARE)
    return configured_share(load_config(DEFAULT_REPOSITORIES[0] / model / "config.pbtxt"))


class Direct:
    def __init__(self, preset: Preset, device: str):
        from triton_omni.ar import ArRunner, ArRunnerConfig
        from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig

        self.preset = preset
        needs = set(preset.workloads)
        engines = {"ar": "auto", "ar_transformers": "transformers"}
        # The same GPU memory plan as the server's: every runner here lives at once.
        self.generators = {workload: ArRunner(ArRunnerConfig(
            preset.ar_model, "generate", engine=engines[workload], device=device,
            gpu_memory_utilization=gpu_share(workload),
            engine_args=preset.engine_args("ar") if workload == "ar" else {},
            engine_cpus=preset.engine_cpus if workload == "ar" else ""))
            for workload in GENERATION_WORKLOADS if workload in needs}
        # every other workload needs embeddings (diffusion takes one precomputed prompt's)
        self.encoder = ArRunner(ArRunnerConfig(preset.ar_model, "encode", device=device,
                                               gpu_memory_utilization=gpu_share("ar_encoder"),
                                               engine_args=preset.engine_args("ar_encoder"),
                                               engine_cpus=preset.engine_cpus)) \
            if needs - set(GENERATION_WORKLOADS) else None
        diffusion_config = DiffusionRunnerConfig(preset.diffusion_model, device=device,
                                                 batch_size=preset.max_batch_size,
                                                 exact_batching=preset.exact_batching,
                                                 limits={"max_size": max(1024, preset.size)},
                                                 gpu_memory_utilization=gpu_share("diffusion"))
        self.diffusion = DiffusionRunner(diffusion_config) if needs - {*GENERATION_WORKLOADS, "ar_encoder"} \
            else None
        self.embeds = self._encode(1)[0] if self.encoder else None

    def gpu_share(self) -> float:
        """The GPU memory shares of the runners held here, added up (they run on GPU 0)."""
        held = [*self.generators, *(["ar_encoder"] if self.encoder else []),
                *(["diffusion"] if self.diffusion else [])]
        return sum(gpu_share(model) or 0.0 for model in held)

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

    def closed_loop_call(self, workload: str):
        """(a coroutine function making client ``i``'s next request, the event loop it runs on)."""
        if workload == "ar_encoder":
            return self._encode_call(), self.encoder.loop
        return self.stream_call(workload), self.generators[workload].loop

    def _encode_call(self):
        """One prompt encoded: the raw vLLM ``AsyncLLM`` (token ids in, the
        pooling parameters ``ar_encoder`` uses), or the runner's engine call
        for transformers. Returns the latency in seconds."""
        runner = self.encoder
        prompt_ids = runner.tokenize(PROMPT)
        raw = runner.engine.engine if runner.engine_name == "vllm" else None
        if raw is not None:
            from triton_omni.ar.engine_vllm import engine_input
            from vllm import PoolingParams

            params = PoolingParams(task="token_embed", use_activation=False)

        async def one(client: int) -> float:
            start = time.perf_counter()
            if raw is None:
                await runner.engine.encode([prompt_ids])
            else:
                async for _ in raw.encode(engine_input(prompt_ids), params, uuid.uuid4().hex):
                    pass
            return time.perf_counter() - start

        return one

    def stream_call(self, workload: str):
        """A coroutine function streaming client ``i``'s next generation request
        (its length from ``Preset.output_lengths``): the raw vLLM ``AsyncLLM``
        (token ids in, DELTA outputs) for vLLM, the engine through the runner
        for transformers."""
        runner = self.generators[workload]
        lengths = ClientLengths(self.preset)
        if runner.engine_name == "vllm":
            return self._raw_vllm_stream(runner, lengths)
        from triton_omni.ar import GenerateRequest

        @functools.cache  # one per length, as for vLLM below
        def parsed(max_tokens: int) -> GenerateRequest:
            return GenerateRequest.from_inputs({"text_input": PROMPT, "stream": True, "sampling_parameters":
                                                json.dumps(generation_options(max_tokens))}, runner.config.limits)

        async def one(client: int) -> Stream:
            request = parsed(lengths.next(client))
            start, marks = time.perf_counter(), []
            async for response in runner.generate(request, uuid.uuid4().hex):
                marks.append((time.perf_counter(), sum(response.num_output_tokens)))
            return Stream.from_marks(start, marks)

        return one

    def _raw_vllm_stream(self, runner, lengths: ClientLengths):
        from triton_omni.ar.engine_vllm import engine_input  # the prompt as the stub gives it
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = runner.engine.engine  # the AsyncLLM itself
        prompt_ids = runner.tokenize(PROMPT)

        @functools.cache  # one per length, built before the clock starts for a single length
        def sampling(max_tokens: int) -> SamplingParams:
            return SamplingParams(**generation_options(max_tokens), output_kind=RequestOutputKind.DELTA)

        async def one(client: int) -> Stream:
            params = sampling(lengths.next(client))
            start, marks = time.perf_counter(), []
            async for output in llm.generate(engine_input(prompt_ids), params, uuid.uuid4().hex):
                marks.append((time.perf_counter(), len(output.outputs[0].token_ids)))
            return Stream.from_marks(start, marks)

        return one

    def call(self, workload: str) -> Callable[[int], None]:
        return {
            "diffusion": lambda c: self._diffuse([self.embeds] * c),
            "ar_encoder": lambda c: self._encode(c),
            "text_to_image": lambda c: self._diffuse(self._encode(c)),
            "omni": lambda c: self._diffuse(self._encode(c)),
        }[workload]

    def close(self) -> None:
        for runner in (*self.generators.values(), self.encoder):
            if runner is not None:
                runner.close()
        self.diffusion = None
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure_direct_points(direct: Direct, preset: Preset, workload: str, concurrency: int,
                          references: bool = True) -> Iterator[Point]:
    """The direct side of one point, and (``references``) the reference
    curves measured beside it: ``batch`` for ``ar_encoder``, ``eager`` for
    diffusion with CUDA graphs."""
    if workload in AR_WORKLOADS:  # closed-loop clients in the engine's own event loop
        yield measure_direct_closed_loop(direct, workload, concurrency, preset.rounds_for(workload))
        if references and workload == "ar_encoder":
            yield measure_direct(direct, workload, concurrency, concurrency * preset.rounds_for(workload), side="batch")
        return
    yield measure_direct(direct, workload, concurrency, concurrency * preset.requests_per_worker)
    if references and workload == "diffusion" and direct.diffusion.graphs is not None:
        yield measure_eager(direct, concurrency, concurrency * preset.requests_per_worker)


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


def measure_direct_closed_loop(direct: Direct, workload: str, concurrency: int, per_worker: int) -> Point:
    """``concurrency`` closed-loop clients in the engine's own event loop, each
    sending ``per_worker`` requests one after another (after a warm-up round),
    as the Triton side's clients do: the AR engines batch whatever is in
    flight, so the direct figure is the same engine under the same load."""
    one, loop = direct.closed_loop_call(workload)

    async def clients(rounds: int) -> list[Stream | float]:
        async def client(index: int) -> list[Stream | float]:
            return [await one(index) for _ in range(rounds)]

        return [s for streams in await asyncio.gather(*(client(i) for i in range(concurrency))) for s in streams]

    loop.run(clients(1))
    cpu = CpuWindow(engine_cores(os.getpid(), children_only=True)).start()
    start = time.perf_counter()
    results = loop.run(clients(per_worker), timeout=3600)
    seconds = time.perf_counter() - start
    if workload not in GENERATION_WORKLOADS:  # latencies
        point = Point(workload, concurrency, "direct", len(results), seconds, results)
    else:
        point = Point(workload, concurrency, "direct", len(results), seconds, [s.latency_s for s in results],
                      streams=results)
    point.cores = cpu.stop()
    return point


def measure_eager(direct: Direct, concurrency: int, requests: int) -> Point:
    """Diffusion direct with the UNet's CUDA graphs off: plain eager
    diffusers, the raw curve, measured in the same run as the rest."""
    direct.diffusion.graphs.enabled = False
    try:
        return measure_direct(direct, "diffusion", concurrency, requests, side="eager")
    finally:
        direct.diffusion.graphs.enabled = True


# -- triton: the same work through the server -------------------------------------


def triton_call(workload: str, url: str, preset: Preset, embeds: np.ndarray, index: int = 0) -> Callable[[], None]:
    """One client's call (``index``: the client's, which sets its output lengths)."""
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

    def text_to_image():
        inputs = batched_inputs(grpcclient, text_input=PROMPT, **image_options)
        check(client.infer("text_to_image", inputs), "image")

    def omni():
        values = {"text_input": PROMPT, "modalities": ["image"], "stream": False, **image_options}
        [result] = list(stream_infer(url, "omni", omni_inputs(grpcclient, values)))
        check(result, "image")

    if workload in GENERATION_WORKLOADS:
        return _generation_call(client, workload, preset, index)
    calls = {"diffusion": diffusion, "ar_encoder": ar_encoder, "text_to_image": text_to_image, "omni": omni}
    return calls[workload]


def _generation_call(client, model: str, preset: Preset, index: int) -> Callable[[], Stream]:
    """Streams client ``index``'s next request over its one gRPC stream, opened
    once (as a serving client keeps its channel), and times every response."""
    import queue

    import tritonclient.grpc as grpcclient
    from triton_omni_client.client import omni_inputs

    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
    lengths = preset.output_lengths(index)

    @functools.cache
    def inputs(max_tokens: int) -> list:
        return omni_inputs(grpcclient, {"text_input": PROMPT, "stream": True, "return_num_output_tokens": True,
                                        "sampling_parameters": json.dumps(generation_options(max_tokens))})

    def call() -> Stream:
        request = inputs(next(lengths))
        start, marks = time.perf_counter(), []
        client.async_stream_infer(model, request)
        while True:
            at, result, error = responses.get(timeout=600)
            if error is not None:
                raise error
            tokens = result.as_numpy("num_output_tokens")
            marks.append((at, 0 if tokens is None else int(tokens.sum())))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return Stream.from_marks(start, marks)

    return call


def measure_triton(url: str, preset: Preset, embeds: np.ndarray, workload: str, concurrency: int,
                   metrics_url: str, server_pid: int | None = None) -> Point:
    """``concurrency`` closed-loop clients, each with its own connection, in
    client *processes*: one per client for the image workloads (threads in one
    process would serialise on the GIL decoding images and make the load
    generator the bottleneck), at most ``preset.client_processes`` for the AR
    stages, whose responses are small but many (64 processes of gRPC threads
    took CPU time from vLLM's engine loop on a 16-core host). ``server_pid``:
    the stubs' CPU use in the window is measured too (``Point.stub_cores``)."""
    import multiprocessing

    from triton_omni_tools.supervisor import stub_cpu_seconds

    if workload not in AR_WORKLOADS and preset.diffusion_batching == "step":
        warm_step_counts(url, preset, embeds, workload, concurrency)
    processes = min(concurrency, preset.client_processes) if workload in AR_WORKLOADS else concurrency
    clients = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    ready, results, warm, go = context.Queue(), context.Queue(), context.Event(), context.Event()
    firsts = itertools.accumulate(clients[:-1], initial=0)  # each process's first client index
    workers = [context.Process(target=_client_process,
                               args=(url, preset, embeds, workload, first, n, ready, warm, go, results))
               for first, n in zip(firsts, clients, strict=True)]
    for worker in workers:
        worker.start()
    for _ in workers:  # connected: warm up together
        ready.get()
    warm.set()
    for _ in workers:  # warmed up
        ready.get()
    metrics_before, stats_before = metrics_text(metrics_url), _server_stats(url, workload)
    cpu_before = stub_cpu_seconds(server_pid) if server_pid else {}
    cpu = CpuWindow(engine_cores(server_pid), server_pid).start() if server_pid else None
    start = time.time()
    go.set()
    outcomes = [results.get() for _ in workers]
    cpu_after, window = stub_cpu_seconds(server_pid) if server_pid else {}, time.time() - start
    cores = cpu.stop() if cpu else None
    for worker in workers:
        worker.join()
    errors = [error for *_, error in outcomes if error]
    if errors:
        raise RuntimeError(f"{len(errors)} {workload} client process(es) failed; first: {errors[0]}")
    latencies = [latency for lat, *_ in outcomes for latency in lat]
    streams = [stream for _, client_streams, _, _ in outcomes for stream in client_streams]
    point = Point(workload, concurrency, "triton", len(latencies), max(end for *_, end, _ in outcomes) - start,
                  latencies, streams=streams if workload in GENERATION_WORKLOADS else None)
    metrics_after = metrics_text(metrics_url)
    point.mean_batch = _mean_batch(_batch_counts(metrics_before, workload), _batch_counts(metrics_after, workload))
    point.server = _stats_delta(stats_before, _server_stats(url, workload))
    point.cores = cores
    if server_pid:
        point.stub_cores = {model: (cpu_after[model] - cpu_before.get(model, 0.0)) / window
                            for model in sorted(cpu_after)}
    if workload not in AR_WORKLOADS:
        before, after = _diffusion_counters(metrics_before), _diffusion_counters(metrics_after)
        point.counters = {key: after[key] - before.get(key, 0.0) for key in after}
    return point


def _diffusion_counters(text: str) -> dict[str, float]:
    """``diffusion``'s steps per device (does every GPU carry its share?) and CUDA graph
    captures (any in a timed window means the warm-up missed a shape), from /metrics' text."""
    steps = metric_by_device(text, "omni_diffusion_steps_total", "diffusion")
    captures = metric_by_device(text, "omni_diffusion_graph_captures_total", "diffusion")
    return {f"steps_{device}": value for device, value in steps.items()} | {"graph_captures": sum(captures.values())}


def warm_step_counts(url: str, preset: Preset, embeds: np.ndarray, workload: str, concurrency: int) -> None:
    """Step batching meets every request count from 1 to ``concurrency`` as
    closed-loop clients drift apart, and each instance captures a CUDA graph
    for each new padded row count; each is met here first, as the direct
    side's warm-up meets its one batch size. Requests spread over the
    instances by their load (triton/balance.py), so n instances meet every
    count k from k x n requests at once, one more for the drift."""
    instances = instance_count(url, "diffusion")
    for k in range(_warmed.get(url, 0) + 1, -(-concurrency // instances) + 2):
        _, _, error = _closed_loop([triton_call(workload, url, preset, embeds) for _ in range(k * instances)], 1)
        if error:
            raise RuntimeError(f"{workload} warm-up: {error}")
        _warmed[url] = k


# The request counts per instance each server's diffusion has met (its graphs stay captured): the
# image workloads all end in the same `diffusion` model, so one warm-up per server is enough.
_warmed: dict[str, int] = {}


def instance_count(url: str, model: str) -> int:
    """The instances Triton runs of ``model``: each group's count, on each of its GPUs."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        groups = client.get_model_config(model, as_json=True)["config"].get("instance_group", [])
    return max(1, sum(int(g.get("count", 1)) * max(1, len(g.get("gpus", []))) for g in groups))


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


def _client_process(url, preset, embeds, workload, first, clients, ready, warm, go, results) -> None:
    """``clients`` closed-loop clients (indices from ``first``), a thread and a connection each."""
    calls = [triton_call(workload, url, preset, embeds, index) for index in range(first, first + clients)]
    ready.put(True)
    warm.wait()
    # Warm-up, all clients at once: the server meets the measured batch size (its
    # kernel selection and CUDA graph capture) before the clock starts.
    _, _, error = _closed_loop(calls, 1)
    ready.put(True)
    go.wait()
    if error is None:
        latencies, streams, error = _closed_loop(calls, preset.rounds_for(workload))
    else:
        latencies, streams = [], []
    results.put((latencies, streams, time.time(), error))


def _closed_loop(calls: list[Callable], rounds: int) -> tuple[list[float], list[Stream], str | None]:
    """Each call made ``rounds`` times one after another, all calls at once
    (a thread each): (latencies, streams, the first error)."""
    import concurrent.futures

    def client(call) -> tuple[list[float], list[Stream]]:
        latencies, streams = [], []
        for _ in range(rounds):
            t0 = time.time()
            stream = call()
            latencies.append(time.time() - t0)
            if stream is not None:
                streams.append(stream)
        return latencies, streams

    latencies, streams = [], []
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        for future in [pool.submit(client, call) for call in calls]:
            try:
                done = future.result()
            except Exception as exc:  # sent back to the parent, which raises it
                return latencies, streams, f"{type(exc).__name__}: {exc}"
            latencies += done[0]
            streams += done[1]
    return latencies, streams, None


def _batch_counts(text: str, workload: str) -> tuple[float, float]:
    """(sum, count) of the executed batch-size histogram of the stage a workload batches on,
    over all its instances (one series per device), from /metrics' text."""
    model = WORKLOADS[workload].batches_on
    family = BATCH_SIZE_METRICS.get(model)
    if family is None:  # a decoupled model: no executed batches to count
        return 0.0, 0.0
    return (sum(metric_by_device(text, f"{family}_sum", model).values()),
            sum(metric_by_device(text, f"{family}_count", model).values()))


def metrics_text(metrics_url: str) -> str:
    import urllib.request

    return urllib.request.urlopen(metrics_url, timeout=5).read().decode()


def metric_by_device(text: str, name: str, model: str) -> dict[str, float]:
    """A metric's value per ``device`` label for one model (``""``: a series without the label)."""
    import re

    values: dict[str, float] = {}
    for labels, value in re.findall(rf'^{name}{{([^}}]*)}} (\S+)$', text, flags=re.M):
        if f'model="{model}"' in labels:
            device = re.search(r'device="([^"]*)"', labels)
            key = device.group(1) if device else ""
            values[key] = values.get(key, 0.0) + float(value)
    return values


def _mean_batch(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count else None


def bench_repository(preset: Preset, dest: Path) -> list[Path]:
    """Copies of the default repositories with the preset's models and batch size."""
    from triton_omni_tools.launcher import DEFAULT_REPOSITORIES
    from triton_omni_tools.repository import copy_model, copy_repositories

    ar = {"model": preset.ar_model}

    def parameters(stage: str) -> dict:  # engine_args and engine_cpus only where the preset sets them
        engine_args = preset.engine_args(stage)
        return (ar | ({"engine_args": engine_args} if engine_args else {})
                | ({"engine_cpus": preset.engine_cpus} if preset.engine_cpus else {}))
    variants = dest / "variants"
    variants.mkdir(parents=True)
    copy_model(DEFAULT_REPOSITORIES[0], "ar", variants, "ar_transformers",
               parameters=ar | {"engine": "transformers", "gpu_memory_utilization": TRANSFORMERS_SHARE})
    return [variants, *copy_repositories(DEFAULT_REPOSITORIES, dest, {
        "ar": {"parameters": parameters("ar")},
        "ar_encoder": {"parameters": parameters("ar_encoder"), "max_batch_size": preset.encoder_max_batch_size,
                       "max_queue_delay_us": preset.encoder_queue_delay_us},
        "diffusion": {
            "parameters": {"model": preset.diffusion_model, "limits": {"max_size": max(1024, preset.size)},
                           "exact_batching": str(preset.exact_batching).lower(),
                           "batching": preset.diffusion_batching},
            "max_batch_size": preset.max_batch_size,
            "max_queue_delay_us": preset.diffusion_queue_delay_us if preset.diffusion_batching == "request" else 0,
            # step batching: one request per execute, spread over instances by load (model_repository's config)
            "preferred_batch_size": [] if preset.diffusion_batching == "request" else [1],
        },
    })]


# -- the run -------------------------------------------------------------------------

DEFAULT_PAIRS = 3


def crowded_gpu(direct_share: float, server_shares: list) -> str | None:
    """Why the direct side's runners cannot stay loaded beside the server's
    models (on GPU 0, where the direct side runs); None when they fit."""
    from triton_omni_tools.memory_plan import MAX_TOTAL_SHARE

    server = sum(s.total for s in server_shares if s.gpu == 0)
    if direct_share + server <= MAX_TOTAL_SHARE + 1e-9:
        return None
    return (f"the direct side's GPU share {direct_share:.2f} and the server's {server:.2f} add up to more than "
            f"{MAX_TOTAL_SHARE}")


def _pair(direct: Direct | None, preset: Preset, workload: str, c: int, turn: int,
          triton: Callable[[], Point]) -> Iterator[Point]:
    """One direct/triton pair of a point, direct first on even turns (the
    references with the first), triton alone where the direct side is gone."""
    # a generator: its measurements run when iterated, in the order below
    direct_side = measure_direct_points(direct, preset, workload, c, references=turn == 0) \
        if direct is not None else ()
    if turn % 2 == 0:
        yield from direct_side
        yield triton()
    else:
        yield triton()
        yield from direct_side


def keep_off(engine_cpus: str) -> None:
    """This process, and so the server, its stubs and the clients it starts,
    off the engine cores' CPUs (each engine core is moved onto them as it
    starts: model parameter ``engine_cpus``)."""
    from triton_omni.cpu_affinity import format_cpus, parse_cpus

    cpus = parse_cpus(engine_cpus, "--engine-cpus")
    rest = os.sched_getaffinity(0) - cpus
    if not rest:
        raise ValueError(f"--engine-cpus {engine_cpus!r} leaves no CPU for the server and the clients")
    os.sched_setaffinity(0, rest)
    print(f"   vLLM engine cores on CPUs {format_cpus(cpus)}, everything else on {format_cpus(rest)}", flush=True)


def run(preset_name: str, concurrency: tuple[int, ...] | None, workloads: tuple[str, ...] | None,
        out_dir: Path, diffusion_batching: str | None = None, placement: list[str] | None = None,
        pairs: int = DEFAULT_PAIRS, ar_engine_args: str | None = None, encoder_engine_args: str | None = None,
        client_processes: int | None = None, encoder_queue_delay_us: int | None = None,
        engine_cpus: str | None = None, output_range_ratio: float | None = None) -> list[dict]:
    """Measure every point of the preset on both sides and report them.

    Where the direct side's runners fit on the GPU beside the server's (on
    CPU, always), each point is measured as ``pairs`` direct/triton pairs,
    back to back, the order alternating (direct first, then triton first, ...),
    and the report takes the median of the pairs' ratios. Why: a shared
    host's throughput drifts over minutes, so a direct figure taken a quarter
    of an hour before its Triton figure is not side by side. Otherwise (a full realistic
    run: every stage twice does not fit one GPU) the direct side runs first
    and is freed before the server starts."""
    import torch
    from triton_omni.demo_models import resolve_model

    from triton_omni_tools.launcher import ServerOptions, TritonServer, vllm_gpu_env

    for key, value in vllm_gpu_env().items():  # the direct side runs vLLM in this process
        os.environ.setdefault(key, value)
    preset = PRESETS[preset_name]
    overrides = {"workloads": workloads} if workloads else {}
    if diffusion_batching:
        overrides["diffusion_batching"] = diffusion_batching
    if ar_engine_args:
        overrides["ar_engine_args"] = ar_engine_args
    if encoder_engine_args:
        overrides["encoder_engine_args"] = encoder_engine_args
    if client_processes:
        overrides["client_processes"] = client_processes
    if encoder_queue_delay_us is not None:
        overrides["encoder_queue_delay_us"] = encoder_queue_delay_us
    if output_range_ratio is not None:
        overrides["output_range_ratio"] = output_range_ratio
    if engine_cpus:
        overrides["engine_cpus"] = engine_cpus
        keep_off(engine_cpus)
    if concurrency:  # one list for every workload
        overrides |= {"concurrency": concurrency, "ar_concurrency": concurrency}
    preset = Preset(**(asdict(preset) | overrides))
    resolve_model(preset.ar_model), resolve_model(preset.diffusion_model)  # build demo models before timing
    if preset.output_range_ratio:
        low, high = preset.output_range()
        print(f"   text generation: max_tokens {low} to {high}, the same lengths on both sides", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    points: list[Point] = []
    out_dir.mkdir(parents=True, exist_ok=True)

    def record(point: Point) -> None:
        """Keep every point on disk as it comes: a run cut short still leaves its figures."""
        points.append(point)
        progress(point)
        (out_dir / "points.json").write_text(json.dumps([p.summary() for p in points], indent=2))

    print(f"== direct ({device})", flush=True)
    direct: Direct | None = Direct(preset, device)
    embeds = direct.embeds.float().cpu().numpy() if direct.embeds is not None else None
    with tempfile.TemporaryDirectory(prefix="omni-bench-") as tmp:
        options = ServerOptions(model_repositories=bench_repository(preset, Path(tmp)), http_port=18100,
                                grpc_port=18101, metrics_port=18102, log_file=out_dir / "server.log",
                                model_control_mode="explicit", load_models=models_for(preset.workloads),
                                placement=placement or [])
        server = TritonServer(options)
        crowded = crowded_gpu(direct.gpu_share(), server.memory_shares()) if device == "cuda" else None
        if crowded:  # the direct side first, freed before the server starts
            print(f"   one side at a time: {crowded}", flush=True)
            for workload in preset.workloads:
                for c in preset.concurrency_for(workload):
                    for point in measure_direct_points(direct, preset, workload, c):
                        record(point)
            direct.close()
            direct, pairs = None, 1
        print("== triton" + (f", each point in {pairs} direct/triton pairs" if direct else ""), flush=True)
        try:
            with server:
                for workload in preset.workloads:
                    for c in preset.concurrency_for(workload):
                        triton = functools.partial(measure_triton, server.grpc_url, preset, embeds, workload, c,
                                                   server.metrics_url, server.process.pid)
                        for turn in range(pairs):
                            for point in _pair(direct, preset, workload, c, turn, triton):
                                point.turn = turn
                                record(point)
        finally:
            if direct is not None:
                direct.close()

    rows = table(points)
    (out_dir / "bench.json").write_text(json.dumps(
        {"preset": asdict(preset), "device": device_name(), "placement": placement or [], "pairs": pairs,
         "rows": rows,
         "points": [p.summary() for p in points]}, indent=2))
    plot(rows, out_dir / "bench.png", f"omni-triton bench --preset {preset_name} ({device_name()})")
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")
    return rows


