"""``omni-triton bench --open-loop``: diffusion under open traffic, step
batching against request batching, side by side on one server.

A closed loop measures throughput; users meet latency under traffic that
does not wait for them. Here requests arrive as a Poisson process (seeded,
the same arrival times for both modes) and every one is sent at its time,
whatever is still in flight:

1. the peak: the request-batching model's closed-loop throughput at
   concurrency ``max_batch_size`` (its best batch);
2. for each load (50 % and 80 % of that peak): ``requests`` arrivals at that
   rate to each mode; p50/p99 latency and the throughput reached;
3. mixed traffic: steps 10/20/50 at two sizes, interleaved; each class's
   latency against the same class alone, in each mode, and in step mode
   with the two sizes' groups in each ``group_order``: most behind (the
   default), in turn, shortest first. Two readings of 50 % load: 50 % of
   request batching's peak on the mix, every mode at that one rate (as the
   Poisson points); then each step mode at 50 % of step batching's own,
   higher peak.

The server loads a copy of the preset's diffusion model per mode measured:
``diffusion`` (step batching), ``diffusion_request`` (request batching, with
the preset's batching window), ``diffusion_shortest_first`` and
``diffusion_round_robin``; they are measured one at a time.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from triton_omni_tools.bench.openloop_plot import load_basis, mixed_readings, plot
from triton_omni_tools.bench.presets import PROMPT, Preset

MODES = {"request": "diffusion_request", "step": "diffusion"}
# Mixed traffic also runs step batching with its groups (sizes) in the other orders.
MIXED_MODES = MODES | {"step_round_robin": "diffusion_round_robin", "step_shortest_first": "diffusion_shortest_first"}
# The GPU share that every mode's copy of ``diffusion`` splits (memory_plan.MAX_TOTAL_SHARE less a margin).
COPIES_SHARE = 0.9
# What each mode's copy of ``diffusion`` changes (request batching also gets the preset's window).
MODE_PARAMETERS = {"diffusion_request": {"batching": "request"},
                   "diffusion_shortest_first": {"group_order": "shortest_first"},
                   "diffusion_round_robin": {"group_order": "round_robin"}}


@dataclass(frozen=True)
class ImageClass:
    steps: int
    size: int

    @property
    def name(self) -> str:
        return f"{self.steps} steps {self.size}px"


def poisson_arrivals(rate_per_s: float, count: int, seed: int) -> np.ndarray:
    """Send times (s from the start) of ``count`` Poisson arrivals."""
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate_per_s, count))


class ImageSender:
    """One gRPC connection; each request sent without waiting for the others (``async_infer``)."""

    def __init__(self, url: str, preset: Preset):
        import tritonclient.grpc as grpcclient

        self.grpcclient = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.preset = preset

    def send(self, model: str, image: ImageClass, seed: int, done) -> None:
        """``done(latency_s, error)`` runs on a gRPC thread when the image is back."""
        from triton_omni_client.client import batched_inputs

        inputs = batched_inputs(self.grpcclient, prompt=PROMPT, seed=seed, num_inference_steps=image.steps,
                                guidance_scale=self.preset.guidance, height=image.size, width=image.size)
        start = time.perf_counter()

        def callback(result, error) -> None:
            ok = error is None and result.as_numpy("image") is not None
            done(time.perf_counter() - start, None if ok else str(error or "no image in the response"))

        self.client.async_infer(model, inputs, callback)

    def one(self, model: str, image: ImageClass, seed: int = 0) -> float:
        """Send one request and wait for it: its latency."""
        finished, out = threading.Event(), {}

        def done(latency: float, error: str | None) -> None:
            out.update(latency=latency, error=error)
            finished.set()

        self.send(model, image, seed, done)
        finished.wait(600)
        if out.get("error") or "latency" not in out:
            raise RuntimeError(f"{model}: {out.get('error', 'no answer in 600 s')}")
        return out["latency"]

    def close(self) -> None:
        self.client.close()


def run_schedule(sender: ImageSender, model: str, arrivals: np.ndarray, classes: list[ImageClass]) -> dict:
    """Each request sent at its arrival time; returns latencies (per class too) and the rate reached."""
    latencies: list[tuple[ImageClass, float]] = []
    errors: list[str] = []
    lock, all_done = threading.Lock(), threading.Event()

    def done(image: ImageClass, latency: float, error: str | None) -> None:
        with lock:
            (errors.append(error) if error else latencies.append((image, latency)))
            if len(latencies) + len(errors) == len(arrivals):
                all_done.set()

    start = time.perf_counter()
    for i, (at, image) in enumerate(zip(arrivals, classes, strict=True)):
        if (wait := start + at - time.perf_counter()) > 0:
            time.sleep(wait)
        sender.send(model, image, i, lambda latency, error, image=image: done(image, latency, error))
    if not all_done.wait(1800):
        raise RuntimeError(f"{model}: {len(arrivals) - len(latencies) - len(errors)} requests unanswered after 30 min")
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{model}: {len(errors)} of {len(arrivals)} requests failed; first: {errors[0]}")
    values = np.array([latency for _, latency in latencies])
    by_class = {}
    for image in dict.fromkeys(classes):
        mine = np.array([latency for c, latency in latencies if c == image])
        by_class[image.name] = {"p50_ms": _ms(mine, 50), "p99_ms": _ms(mine, 99), "requests": len(mine)}
    return {"requests": len(values), "per_s": len(values) / seconds, "p50_ms": _ms(values, 50),
            "p99_ms": _ms(values, 99), "by_class": by_class}


def _at_once(senders: list[ImageSender], work) -> None:
    """``work(i, sender)`` on a thread per sender, all started together; returns when all are done."""
    threads = [threading.Thread(target=work, args=(i, sender)) for i, sender in enumerate(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def closed_loop_peak(url: str, preset: Preset, model: str, classes: list[ImageClass], concurrency: int,
                     rounds: int) -> float:
    """Requests/s of ``concurrency`` clients, each sending every class ``rounds`` times back to back
    (after a warm-up request). Each client starts at another class, so all carry the same work and
    end about together: a client with only short requests would leave early, and the others would
    finish at a lower concurrency (the drain; with 10 to 50 steps it read 0.75-0.89 of the peak)."""
    senders = [ImageSender(url, preset) for _ in range(concurrency)]
    plans = [[classes[(i + k) % len(classes)] for k in range(rounds * len(classes))] for i in range(concurrency)]

    def client(plan: list[ImageClass], sender: ImageSender) -> None:
        for k, image in enumerate(plan):
            sender.one(model, image, k)

    _at_once(senders, lambda i, sender: client(plans[i][:1], sender))  # warm-up: every batch size and class met
    start = time.perf_counter()
    _at_once(senders, lambda i, sender: client(plans[i], sender))
    seconds = time.perf_counter() - start
    for sender in senders:
        sender.close()
    return concurrency * len(plans[0]) / seconds


def warm_up(url: str, preset: Preset, model: str, classes: list[ImageClass], up_to: int) -> None:
    """k requests of each class at once, for every k up to ``up_to``: every batch size (and, with
    step batching, padded row count and its CUDA graph) is met before anything is timed."""
    senders = [ImageSender(url, preset) for _ in range(up_to)]
    for image in classes:
        for k in range(1, up_to + 1):
            _at_once(senders[:k], lambda i, sender, image=image: sender.one(model, image))
    for sender in senders:
        sender.close()


def solo_latency(sender: ImageSender, model: str, image: ImageClass, repeats: int = 3) -> float:
    sender.one(model, image)  # warm-up
    return float(np.median([sender.one(model, image, k) for k in range(repeats)]) * 1e3)


def measure(url: str, preset: Preset, loads: tuple[float, ...], requests: int, mixed_modes: tuple[str, ...],
            report: dict, save: Callable[[], None]) -> None:
    """Fills ``report`` point by point and calls ``save()`` after each, so that a run cut short (a time
    limit, a machine taken back) still leaves every point it measured."""
    sender = ImageSender(url, preset)
    try:
        if loads:
            measure_loads(url, preset, sender, ImageClass(preset.steps, preset.size), loads, requests, report, save)
        if mixed_modes:
            measure_mixed(url, preset, sender, requests, mixed_modes, report, save)
    finally:
        sender.close()


def measure_loads(url: str, preset: Preset, sender: ImageSender, standard: ImageClass, loads: tuple[float, ...],
                  requests: int, report: dict, save: Callable[[], None]) -> None:
    """Request batching's closed-loop peak, then Poisson arrivals at each fraction of it, in both modes
    (into ``report["peak_per_s"]`` and ``report["loads"]``)."""
    for model in MODES.values():
        warm_up(url, preset, model, [standard], preset.max_batch_size)
    peak = closed_loop_peak(url, preset, MODES["request"], [standard], preset.max_batch_size, rounds=3)
    report["peak_per_s"] = peak
    print(f"  request-batching peak (closed loop, concurrency {preset.max_batch_size}): {peak:.2f}/s", flush=True)
    for k, load in enumerate(loads):
        arrivals = poisson_arrivals(load * peak, requests, seed=k)
        report["loads"][load] = {}
        for mode, model in MODES.items():
            result = run_schedule(sender, model, arrivals, [standard] * requests)
            report["loads"][load][mode] = result
            save()
            print(f"  load {load:.0%} ({load * peak:.2f}/s offered) {mode:<8} {result['per_s']:6.2f}/s  "
                  f"p50 {result['p50_ms']:8.1f} ms  p99 {result['p99_ms']:8.1f} ms", flush=True)


def measure_mixed(url: str, preset: Preset, sender: ImageSender, requests: int, modes: tuple[str, ...],
                  report: dict, save: Callable[[], None], load: float = 0.5) -> None:
    """The preset's steps counts (10/20/50) at its two sizes, interleaved, Poisson arrivals; each class's
    p50 against its latency alone in the same mode. Two readings of "``load`` of the peak":

    - ``by_request_peak``: every mode at ``load`` of request batching's closed-loop peak on the mix,
      the same arrivals for all; the load the Poisson points use, so the modes are compared at one
      offered rate;
    - ``by_own_peak``: each step mode again at ``load`` of step batching's own peak on the mix (higher),
      the stricter reading, where step batching is as busy as request
      batching is in the first.
    """
    classes = [ImageClass(steps, size) for steps in preset.mixed_steps for size in preset.mixed_sizes]
    rng = np.random.default_rng(7)
    order = [classes[i] for i in rng.integers(0, len(classes), requests)]
    solo = {}
    for mode in modes:
        model = MIXED_MODES[mode]
        # up to the peak's concurrency: every padded row count the peak meets has its CUDA graph
        # before it is timed (a capture waits for the GPU)
        warm_up(url, preset, model, classes, preset.max_batch_size)
        solo[mode] = {image.name: solo_latency(sender, model, image) for image in classes}
    # One peak per batching, measured once: an order changes which group steps, not the work, and
    # peaks measured apart differ by more than the orders do, and would move the offered load.
    if "request" not in modes:
        warm_up(url, preset, MIXED_MODES["request"], classes, preset.max_batch_size)
    step_modes = [mode for mode in modes if mode != "request"]
    peaks = {"request": closed_loop_peak(url, preset, MIXED_MODES["request"], classes, preset.max_batch_size, 1)}
    if step_modes:
        peaks["step"] = closed_loop_peak(url, preset, MIXED_MODES[step_modes[0]], classes, preset.max_batch_size, 1)
    print(f"  mixed traffic peaks (closed loop, concurrency {preset.max_batch_size}): request batching "
          f"{peaks['request']:.2f}/s" + (f", step batching {peaks['step']:.2f}/s" if step_modes else ""), flush=True)
    readings = {"by_request_peak": (modes, "request"), "by_own_peak": (step_modes, "step")}
    out = report["mixed"] = {}
    for reading, (reading_modes, peak_of) in readings.items():
        out[reading] = {}
        for mode in reading_modes:
            peak = peaks[peak_of]
            result = run_schedule(sender, MIXED_MODES[mode], poisson_arrivals(load * peak, requests, seed=11), order)
            for name, stats in result["by_class"].items():
                stats |= {"solo_ms": solo[mode][name], "p50_over_solo": stats["p50_ms"] / solo[mode][name]}
            worst = max(stats["p50_over_solo"] for stats in result["by_class"].values())
            out[reading][mode] = result | {"peak_per_s": peak, "peak_of": peak_of, "load": load,
                                           "worst_p50_over_solo": worst}
            save()
            print(f"  mixed {mode:<19} at {load:.0%} of {peak_of} batching's peak ({load * peak:.2f}/s offered): "
                  f"worst class p50/solo {worst:.2f}", flush=True)


def table(report: dict) -> None:
    if report["loads"]:
        _loads_table(report)
    for reading, results in mixed_readings(report).items():
        load = next(iter(results.values()))["load"]
        print(f"\nmixed traffic at {load:.0%} of {load_basis(results)} ({reading}): "
              "p50 of each class against it alone (ms)")
        for mode, result in results.items():
            offered, worst = result["load"] * result["peak_per_s"], result["worst_p50_over_solo"]
            print(f"  {mode} ({offered:.2f}/s offered; worst {worst:.2f}): "
                  + ", ".join(f"{name} {c['p50_ms']:.0f}/{c['solo_ms']:.0f}={c['p50_over_solo']:.2f}"
                              for name, c in result["by_class"].items()))


def _loads_table(report: dict) -> None:
    print("\nopen loop (Poisson arrivals): request batching against step batching")
    header = (f"{'load':>6}{'offered/s':>11}{'req p50':>10}{'step p50':>10}{'p50 x':>7}"
              f"{'req p99':>10}{'step p99':>10}{'p99 x':>7}{'req/s':>8}{'step/s':>8}")
    print(header + "\n" + "-" * len(header))
    for load, modes in report["loads"].items():
        r, s = modes["request"], modes["step"]
        print(f"{float(load):>6.0%}{float(load) * report['peak_per_s']:>11.2f}{r['p50_ms']:>10.0f}"
              f"{s['p50_ms']:>10.0f}{r['p50_ms'] / s['p50_ms']:>7.2f}{r['p99_ms']:>10.0f}{s['p99_ms']:>10.0f}"
              f"{r['p99_ms'] / s['p99_ms']:>7.2f}{r['per_s']:>8.2f}{s['per_s']:>8.2f}")


def repository(preset: Preset, dest: Path, loaded: int = len(MIXED_MODES)) -> list[Path]:
    """The bench repository (``diffusion``: step batching) plus a copy of ``diffusion`` per other mode
    (``MODE_PARAMETERS``), of which ``loaded`` will be loaded."""
    from dataclasses import replace

    from triton_omni_tools.bench.harness import bench_repository
    from triton_omni_tools.memory_plan import configured_share
    from triton_omni_tools.repository import copy_model, edit_config, load_config

    repositories = bench_repository(replace(preset, diffusion_batching="step"), dest)
    variants, models = repositories[0], repositories[1]
    # The loaded copies live at once (measured one at a time), so together they must fit the GPU
    # memory plan: each gets an equal part of it, at most what diffusion's config asks.
    config = models / "diffusion" / "config.pbtxt"
    share = min(configured_share(load_config(config)) or 1.0, COPIES_SHARE / loaded)
    edit_config(config, parameters={"gpu_memory_utilization": f"{share:.3f}"})
    for name, parameters in MODE_PARAMETERS.items():
        delay = preset.diffusion_queue_delay_us if parameters.get("batching") == "request" else None
        copy_model(models, "diffusion", variants, name, parameters=parameters, max_queue_delay_us=delay)
    return repositories


def run(preset: Preset, preset_name: str, out_dir: Path, loads: tuple[float, ...] = (0.5, 0.8),
        requests: int = 200, mixed_modes: tuple[str, ...] = tuple(MIXED_MODES)) -> dict:
    """``loads``: the Poisson points (empty: none); ``mixed_modes``: the modes mixed traffic runs (empty: none).
    ``open-loop.json`` is rewritten after every point, ``"complete": false`` until the last."""
    from triton_omni.demo_models import resolve_model

    from triton_omni_tools.bench.report import device_name
    from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

    unknown = set(mixed_modes) - set(MIXED_MODES)
    if unknown:
        raise ValueError(f"unknown mixed-traffic modes {sorted(unknown)}; known: {', '.join(MIXED_MODES)}")
    needed = {*(MODES.values() if loads else ()), *(MIXED_MODES[mode] for mode in mixed_modes)}
    if mixed_modes:
        needed.add(MODES["request"])  # its peak on the mix sets the first reading's load
    resolve_model(preset.diffusion_model)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"== open loop, {requests} requests per point ({device_name()})", flush=True)
    path = out_dir / "open-loop.json"
    report: dict = {"preset": preset_name, "device": device_name(), "requests": requests, "complete": False,
                    "loads": {}, "mixed": None}

    def save() -> None:
        path.write_text(json.dumps(report, indent=2, default=str))

    save()  # an earlier run's report in this folder is not left to pass for this one
    with tempfile.TemporaryDirectory(prefix="omni-bench-open-") as tmp:
        options = ServerOptions(model_repositories=repository(preset, Path(tmp), len(needed)), http_port=free_port(),
                                grpc_port=free_port(), metrics_port=free_port(), log_file=out_dir / "server-open.log",
                                model_control_mode="explicit", load_models=sorted(needed))
        with TritonServer(options) as server:
            measure(server.grpc_url, preset, loads, requests, mixed_modes, report, save)
    report["complete"] = True
    save()
    table(report)
    plot(report, out_dir / "open-loop.png",
         f"open loop, {preset_name} preset, {report['device']}, {requests} requests per point")
    print(f"wrote {path} and open-loop.png")
    return report


def _ms(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if len(values) else float("nan")
