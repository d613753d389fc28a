"""``omni-triton bench --gpus 1,2``: the same workloads on 1 GPU and on N,
side by side in one run.

For each GPU count n, a server places its stages (placement.py):
- image workloads (``diffusion``, ``text_to_image``, ``omni``): one
  ``diffusion`` instance on each of GPUs 0..n-1, ``ar_encoder`` (and ``ar``)
  on GPU 0, as the defaults have them;
- ``ar``: one vLLM engine tensor parallel over GPUs 0..n-1 (``ar=tp:...``).

Every point is the Triton side's closed loop (``measure_triton``), so n GPUs
and one GPU are measured the same way; the table prints throughput and p50
against the one-GPU figure of the same concurrency. On a machine without a
GPU, ``--gpus 1`` runs the defaults (the CPU instances), which checks the
harness and nothing else.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from triton_omni_tools.bench.harness import bench_repository, measure_triton
from triton_omni_tools.bench.presets import PROMPT, Preset, models_for
from triton_omni_tools.bench.report import device_name, progress

IMAGE_WORKLOADS = ("diffusion", "text_to_image", "omni")
# The concurrencies the targets name: the one-GPU peak (16) and twice it (32); ar where LLM serving is.
IMAGE_CONCURRENCY = (16, 32)
AR_CONCURRENCY = (64,)
# Image requests per client. The preset's 2 make a point at c=32 on two GPUs last 5 s, in which
# the start (every client at once) and the tail (the last requests finishing alone) weigh; 6 keep
# the closed loop in its steady state for most of the window, for one GPU and N alike.
IMAGE_ROUNDS = 6


def servers(n: int, workloads: tuple[str, ...], have_gpus: bool) -> list[tuple[list[str], tuple[str, ...]]]:
    """The servers of one GPU count: (placement, the workloads measured on it); ``[]``: the defaults."""
    gpus = ",".join(str(g) for g in range(n))
    plan = []
    images = tuple(w for w in workloads if w in IMAGE_WORKLOADS)
    if images:
        plan.append(([f"diffusion={gpus}"] if have_gpus else [], images))
    if "ar" in workloads:
        plan.append(([f"ar=tp:{gpus}"] if have_gpus and n > 1 else [], ("ar",)))
    return plan


def run(preset: Preset, preset_name: str, gpu_counts: tuple[int, ...], out_dir: Path,
        concurrency: tuple[int, ...] | None = None) -> list[dict]:
    from triton_omni.demo_models import resolve_model

    from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port, gpu_count

    preset = replace(preset, requests_per_worker=max(preset.requests_per_worker, IMAGE_ROUNDS))
    workloads = tuple(w for w in preset.workloads if w in (*IMAGE_WORKLOADS, "ar"))
    if not workloads:
        raise SystemExit(f"--gpus measures {', '.join((*IMAGE_WORKLOADS, 'ar'))}; got {preset.workloads}")
    available = gpu_count()
    if max(gpu_counts) > max(available, 1):
        raise SystemExit(f"--gpus {max(gpu_counts)}: this machine has {available} GPU(s)")
    resolve_model(preset.ar_model), resolve_model(preset.diffusion_model)
    out_dir.mkdir(parents=True, exist_ok=True)
    points: list[dict] = []
    print(f"== GPU scaling {gpu_counts} ({device_name()})", flush=True)
    for n in gpu_counts:
        for placement, served in servers(n, workloads, available > 0):
            print(f"-- {n} GPU(s): {' '.join(placement) or 'default placement'}", flush=True)
            with tempfile.TemporaryDirectory(prefix="omni-bench-gpus-") as tmp:
                options = ServerOptions(model_repositories=bench_repository(preset, Path(tmp)), http_port=free_port(),
                                        grpc_port=free_port(), metrics_port=free_port(),
                                        log_file=out_dir / f"server-{n}gpu-{served[0]}.log",
                                        model_control_mode="explicit", load_models=_models(served),
                                        placement=placement)
                with TritonServer(options) as server:
                    embeds = _embeds(server.grpc_url) if "diffusion" in served else None
                    for workload in served:
                        for c in concurrency or (AR_CONCURRENCY if workload == "ar" else IMAGE_CONCURRENCY):
                            point = measure_triton(server.grpc_url, preset, embeds, workload, c, server.metrics_url,
                                                   server.process.pid)
                            progress(point)
                            points.append(point.summary() | {"gpus": n, "placement": placement})
                            (out_dir / "points.json").write_text(json.dumps(points, indent=2))
    rows = table(points)
    (out_dir / "gpus.json").write_text(json.dumps({"preset": asdict(preset), "preset_name": preset_name,
                                                   "device": device_name(), "gpu_counts": gpu_counts,
                                                   "rows": rows, "points": points}, indent=2))
    plot(rows, out_dir / "gpus.png", f"GPU scaling, {preset_name} preset, {device_name()}")
    print(f"wrote {out_dir / 'gpus.json'} and gpus.png")
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Throughput per (workload, concurrency), a bar per GPU count, each
    panel scaled to its own largest bar (PIL only, as report.plot)."""
    from PIL import Image, ImageDraw

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    counts = sorted({r["gpus"] for r in rows})
    colours = ["#9a9a9a", "#76b900", "#3b6fd4", "#d4843b"]
    names = ["grey", "green", "blue", "orange"]
    panel_w, panel_h, margin = 300, 260, 40
    image = Image.new("RGB", (panel_w * len(workloads), panel_h + 60), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 6), title, fill="black")  # the legend on its own line: one panel is too narrow for both
    draw.text((10, 20), ", ".join(f"{names[i % 4]}: {n} GPU(s)" for i, n in enumerate(counts)), fill="black")
    for k, workload in enumerate(workloads):
        data = [r for r in rows if r["workload"] == workload]
        x0, y0, w, h = k * panel_w + margin, 50, panel_w - margin - 20, panel_h - 60
        top = max(r["per_s"] for r in data) * 1.15
        unit = "tokens/s" if data[0].get("unit") == "tokens" else "per s"
        draw.text((x0, y0 - 16), f"{workload} ({unit})", fill="black")
        draw.rectangle([x0, y0, x0 + w, y0 + h], outline="gray")
        concurrencies = sorted({r["concurrency"] for r in data})
        slot = w / len(concurrencies)
        bar = slot * 0.8 / len(counts)
        for i, c in enumerate(concurrencies):
            draw.text((x0 + slot * i + slot / 2 - 12, y0 + h + 4), f"c={c}", fill="gray")
            for j, n in enumerate(counts):
                row = next((r for r in data if r["concurrency"] == c and r["gpus"] == n), None)
                if row is None:
                    continue
                left = x0 + slot * i + slot * 0.1 + bar * j
                height = h * row["per_s"] / top
                draw.rectangle([left, y0 + h - height, left + bar - 2, y0 + h], fill=colours[j % 4])
                label = f"{row['per_s']:.0f}" if row["per_s"] >= 100 else f"{row['per_s']:.1f}"
                draw.text((left, y0 + h - height - 12), label, fill="black")
    image.save(path)


def _models(served: tuple[str, ...]) -> list[str]:
    """What a server loads: its workloads' models, and ``ar_encoder`` for ``diffusion``'s embeddings."""
    return sorted({*models_for(served), *(["ar_encoder"] if "diffusion" in served else [])})


def _embeds(url: str) -> np.ndarray:
    """The bench prompt's embeddings, from the server's own ``ar_encoder`` (what ``diffusion`` is sent)."""
    import tritonclient.grpc as grpcclient
    from triton_omni_client.client import batched_inputs

    with grpcclient.InferenceServerClient(url) as client:
        result = client.infer("ar_encoder", batched_inputs(grpcclient, text_input=PROMPT))
    return result.as_numpy("prompt_embeds")[0]


def table(points: list[dict]) -> list[dict]:
    """Each point against the one-GPU point of its workload and concurrency."""
    base = {(p["workload"], p["concurrency"]): p for p in points if p["gpus"] == min(q["gpus"] for q in points)}
    rows = []
    header = f"{'workload':<14}{'gpus':>5}{'conc':>6}{'per s':>11}{'x 1 GPU':>9}{'p50 ms':>10}{'p50 x 1 GPU':>13}"
    print("\n" + header + "\n" + "-" * len(header))
    for p in points:
        one = base.get((p["workload"], p["concurrency"]))
        row = {"workload": p["workload"], "gpus": p["gpus"], "concurrency": p["concurrency"],
               "placement": p["placement"], "per_s": p["throughput_per_s"], "p50_ms": p["p50_ms"],
               "p99_ms": p["p99_ms"], "unit": p.get("unit", "requests")}
        if one is not None:
            row |= {"scaling": p["throughput_per_s"] / one["throughput_per_s"],
                    "p50_ratio": p["p50_ms"] / one["p50_ms"]}
        rows.append(row)
        nan = float("nan")
        print(f"{row['workload']:<14}{row['gpus']:>5}{row['concurrency']:>6}{row['per_s']:>11.2f}"
              f"{row.get('scaling', nan):>9.2f}{row['p50_ms']:>10.1f}{row.get('p50_ratio', nan):>13.2f}")
    for row in rows:  # the targets' own comparison: N GPUs at c against one GPU at c/2 (its peak)
        half = next((r for r in rows if r["workload"] == row["workload"] and r["gpus"] == 1
                     and r["concurrency"] * row["gpus"] == row["concurrency"]), None)
        if half is not None and row["gpus"] > 1:
            row["p50_vs_one_gpu_at_c_per_gpu"] = row["p50_ms"] / half["p50_ms"]
            print(f"{row['workload']}: {row['gpus']} GPUs at c={row['concurrency']} p50 {row['p50_ms']:.0f} ms "
                  f"= {row['p50_vs_one_gpu_at_c_per_gpu']:.2f} x one GPU's at c={half['concurrency']}")
    return rows
