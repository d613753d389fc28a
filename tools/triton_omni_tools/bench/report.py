"""The bench report: progress lines, the side-by-side table with ratios, the plot."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np


def progress(point) -> None:
    s = point.summary()
    batch = f"  mean batch {s['mean_batch']:.1f}" if s["mean_batch"] else ""
    if s["server"]:
        server = s["server"]
        batch += "  [server ms: " + ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in server.items()) + "]"
    if s.get("counters"):
        batch += _counters(s["counters"])
    if s.get("cores"):
        batch += "  [cores: " + ", ".join(f"{name} {cores:.2f}" for name, cores in s["cores"].items()) + "]"
    if s.get("stub_cores"):
        batch += "  [stub cores: " + ", ".join(f"{model} {cores:.2f}" for model, cores in s["stub_cores"].items()) + "]"
    if s.get("unit") == "tokens":
        batch = f"  TTFT p50 {s['ttft_p50_ms']:.1f} ms  ITL p50 {s['itl_p50_ms']:.2f} ms" + batch
    unit = "tok/s" if s.get("unit") == "tokens" else "/s"
    print(f"  {s['workload']:<15} c={s['concurrency']:<3} {s['side']:<7} {s['throughput_per_s']:8.2f}{unit}  "
          f"p50 {s['p50_ms']:8.1f} ms  p99 {s['p99_ms']:8.1f} ms{batch}", flush=True)


def _counters(counters: dict[str, float]) -> str:
    """Each device's share of diffusion's steps, and the CUDA graph captures, in a timed window."""
    steps = {k.removeprefix("steps_"): v for k, v in counters.items() if k.startswith("steps_")}
    total = sum(steps.values())
    shares = " ".join(f"{device or '?'} {v / total:.0%}" for device, v in sorted(steps.items())) if total else ""
    return f"  [steps {shares}; graph captures {counters.get('graph_captures', 0):.0f}]"


# Reference curves measured beside direct in the same run, each a way of calling the same engine.
REFERENCES = {
    "eager": "diffusion with the UNet's CUDA graphs off: plain eager diffusers",
    "batch": "ar_encoder as one engine call of c prompts at once, the best batch the engine can get",
}


def table(points: list) -> list[dict]:
    """One row per (workload, concurrency). A point measured as several
    direct/triton pairs (``Point.turn``) reports the median of the pairs'
    ratios, and the median of each side's figures; ``ratios`` lists them."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for p in points:
        by_key.setdefault((p.workload, p.concurrency, p.side), {})[p.turn] = p.summary()
    rows = []
    header = (f"{'workload':<14}{'conc':>5}{'direct/s':>10}{'triton/s':>10}{'ratio':>7}"
              f"{'direct p50':>12}{'triton p50':>12}{'direct p99':>12}{'triton p99':>12}  pairs")
    print("\n" + header + "\n" + "-" * len(header))
    for (workload, c, side), direct_turns in by_key.items():
        triton_turns = by_key.get((workload, c, "triton"))
        turns = sorted(direct_turns.keys() & triton_turns.keys()) if side == "direct" and triton_turns else []
        if not turns:  # a reference curve, or a point cut short
            continue
        direct, triton = [direct_turns[t] for t in turns], [triton_turns[t] for t in turns]
        ratios = [t["throughput_per_s"] / d["throughput_per_s"] for d, t in zip(direct, triton, strict=True)]
        d, t = _median_summary(direct), _median_summary(triton)
        row = {"workload": workload, "concurrency": c, "direct_per_s": d["throughput_per_s"],
               "triton_per_s": t["throughput_per_s"], "ratio": float(np.median(ratios)), "ratios": ratios,
               "direct_p50_ms": d["p50_ms"], "triton_p50_ms": t["p50_ms"],
               "direct_p99_ms": d["p99_ms"], "triton_p99_ms": t["p99_ms"]}
        if d.get("unit") == "tokens":
            row |= {"unit": "tokens"} | {f"{side}_{key}": summary[key]
                                         for side, summary in (("direct", d), ("triton", t))
                                         for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}
        for reference in REFERENCES:
            if (measured := by_key.get((workload, c, reference))) is not None:
                ref = _median_summary(list(measured.values()))
                row |= {f"{reference}_per_s": ref["throughput_per_s"],
                        f"ratio_to_{reference}": t["throughput_per_s"] / ref["throughput_per_s"]}
        rows.append(row)
        spread = " ".join(f"{r:.2f}" for r in ratios) if len(ratios) > 1 else ""
        print(f"{workload:<14}{c:>5}{row['direct_per_s']:>10.2f}{row['triton_per_s']:>10.2f}{row['ratio']:>7.2f}"
              f"{row['direct_p50_ms']:>12.1f}{row['triton_p50_ms']:>12.1f}{row['direct_p99_ms']:>12.1f}"
              f"{row['triton_p99_ms']:>12.1f}  {spread}")
    generation_table(rows)
    for reference, meaning in REFERENCES.items():
        measured = [r for r in rows if f"{reference}_per_s" in r]
        if measured:
            print(f"\nagainst '{reference}' ({meaning}), measured in the same run:")
        for r in measured:
            print(f"  {r['workload']:<12} c={r['concurrency']:<3} {reference} {r[f'{reference}_per_s']:.2f}/s  "
                  f"direct {r['direct_per_s']:.2f}/s  triton {r['triton_per_s']:.2f}/s  "
                  f"triton/{reference} {r[f'ratio_to_{reference}']:.2f}")
    return rows


def _median_summary(summaries: list[dict]) -> dict:
    """Each numeric figure's median over a point's turns (one turn: itself)."""
    if len(summaries) == 1:
        return summaries[0]
    merged = dict(summaries[0])
    for key, value in merged.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "turn":
            merged[key] = float(np.median([s[key] for s in summaries]))
    return merged


def generation_table(rows: list[dict]) -> None:
    """Text generation in output tokens/s, time to first token and inter-token latency, and how
    each engine's Triton throughput scales with concurrency."""
    rows = [r for r in rows if r.get("unit") == "tokens"]
    if not rows:
        return
    header = (f"{'workload':<16}{'conc':>5}{'direct tok/s':>13}{'triton tok/s':>13}{'ratio':>7}"
              f"{'TTFT p50 d/t ms':>18}{'TTFT p99 d/t ms':>18}{'ITL p50 d/t ms':>17}{'ITL p99 d/t ms':>17}")
    print("\ntext generation (tokens/s; TTFT and ITL direct/triton)\n" + header + "\n" + "-" * len(header))
    for r in rows:
        pairs = [f"{r[f'direct_{k}']:.1f}/{r[f'triton_{k}']:.1f}" for k in ("ttft_p50_ms", "ttft_p99_ms")]
        pairs += [f"{r[f'direct_{k}']:.2f}/{r[f'triton_{k}']:.2f}" for k in ("itl_p50_ms", "itl_p99_ms")]
        print(f"{r['workload']:<16}{r['concurrency']:>5}{r['direct_per_s']:>13.1f}{r['triton_per_s']:>13.1f}"
              f"{r['ratio']:>7.2f}{pairs[0]:>18}{pairs[1]:>18}{pairs[2]:>17}{pairs[3]:>17}")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        curve = sorted((r["concurrency"], r["triton_per_s"]) for r in rows if r["workload"] == workload)
        if len(curve) > 1 and curve[0][0] == 1:
            print(f"{workload} through Triton, tokens/s against concurrency 1: "
                  + ", ".join(f"c{c} {v / curve[0][1]:.1f}x" for c, v in curve[1:]))


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
        top = max(max(r["direct_per_s"], r["triton_per_s"], *(r.get(f"{ref}_per_s", 0) for ref in REFERENCES))
                  for r in data) * 1.1
        concurrencies = [r["concurrency"] for r in data]

        def xy(i: int, value: float) -> tuple[float, float]:
            return (x0 + w * i / max(1, len(data) - 1), y0 + h - h * value / top)  # noqa: B023

        draw.rectangle([x0, y0, x0 + w, y0 + h], outline="gray")
        unit = "tokens/s" if data[0].get("unit") == "tokens" else "per s"
        draw.text((x0, y0 - 16), f"{workload} ({unit})", fill="black")
        draw.text((x0 - 45, y0), f"{top:.1f}", fill="gray")
        for i, c in enumerate(concurrencies):
            draw.text((xy(i, 0)[0] - 4, y0 + h + 4), str(c), fill="gray")
        for key, colour, dashed in (("eager_per_s", "#3b6fd4", True), ("batch_per_s", "#3b6fd4", True),
                                    ("direct_per_s", "gray", True), ("triton_per_s", "#76b900", False)):
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
        draw.text((x0 + 4, y0 + h + 18), "concurrency; dashed: direct (blue: eager/batch), green: Triton", fill="gray")
    image.save(path)


def device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.machine()}, {__import__('os').cpu_count()} cores"

