"""The plot of ``bench --open-loop``'s report (``open-loop.json``), PIL only.

A panel for each part the report has:
- Poisson load points: p50 and p99 latency of request and step batching at
  each load, as bars;
- mixed traffic, one panel per reading of the load (at request batching's
  peak, at step batching's own): each class's p50 over its latency alone,
  one bar per mode, with the target (1.5) and 1.0 as lines.

``bench --open-loop`` writes ``open-loop.png`` beside the JSON; to redraw a
saved report::

    python -m triton_omni_tools.bench.openloop_plot REPORT.json OUT.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

MIXED_TARGET = 1.5  # issue 12: no class slower than 1.5x alone at 50 % load
COLOURS = {"request": "#8c8c8c", "step": "#76b900", "step_round_robin": "#3b6fd4",
           "step_shortest_first": "#d48a3b"}
PANEL_W, PANEL_H, MARGIN, TOP = 560, 330, 60, 48


def plot(report: dict, path: Path, title: str) -> None:
    from PIL import Image, ImageDraw

    panels = [partial(_loads_panel, report)] if report.get("loads") else []
    panels += [partial(_mixed_panel, results) for results in mixed_readings(report).values()]
    if not panels:
        raise ValueError("the report has neither load points nor mixed traffic to plot")
    image = Image.new("RGB", (PANEL_W * len(panels), PANEL_H + TOP), "white")
    canvas = ImageDraw.Draw(image)
    canvas.text((10, 8), title, fill="black")
    for k, draw_panel in enumerate(panels):
        draw_panel(canvas, k * PANEL_W + MARGIN, TOP + 24, PANEL_W - MARGIN - 20, PANEL_H - 90)
    image.save(path)


def mixed_readings(report: dict) -> dict[str, dict]:
    """The report's mixed-traffic runs by reading of the load (``measure_mixed``), each a dict of
    mode -> result, empty ones left out. Reports written before 2026-11-24's second reading held
    one dict of modes, each at its own peak: they read as ``by_own_peak``."""
    mixed = report.get("mixed") or {}
    if mixed and not set(mixed) & {"by_request_peak", "by_own_peak"}:
        return {"by_own_peak": mixed}
    return {reading: results for reading, results in mixed.items() if results}


def load_basis(results: dict) -> str:
    """What one reading's load is a share of, from its results (mode -> result)."""
    first = next(iter(results.values()))
    return f"{first['peak_of']} batching's peak" if "peak_of" in first else "each mode's own peak"


def _loads_panel(report: dict, canvas, x0: float, y0: float, w: float, h: float) -> None:
    """p50 and p99 (ms) of each mode at each load: a group of four bars per load."""
    loads = report["loads"]
    bars = [(f"{q}_ms", mode, q == "p99") for q in ("p50", "p99") for mode in ("request", "step")]  # p99 lighter
    top = max(loads[load][mode][key] for load in loads for key, mode, _ in bars) * 1.1
    peak = report["peak_per_s"]
    _frame(canvas, x0, y0, w, h, f"Poisson arrivals: latency (ms) at each share of the peak ({peak:.2f}/s)", top)
    group_w = w / len(loads)
    bar_w = group_w * 0.8 / len(bars)
    for g, load in enumerate(loads):
        left = x0 + g * group_w + group_w * 0.1
        for b, (key, mode, light) in enumerate(bars):
            value = loads[load][mode][key]
            _bar(canvas, left + b * bar_w, bar_w, y0 + h, h * value / top, COLOURS[mode], light)
            canvas.text((left + b * bar_w, y0 + h - h * value / top - 12), f"{value:.0f}", fill="gray")
        canvas.text((left + group_w * 0.3, y0 + h + 6), f"{float(load):.0%} load", fill="black")
    _legend(canvas, x0, y0 + h + 24, [("request p50", COLOURS["request"]), ("step p50", COLOURS["step"]),
                                      ("p99: lighter", "#cccccc")])


def _mixed_panel(mixed: dict, canvas, x0: float, y0: float, w: float, h: float) -> None:
    """One reading of the mixed traffic (mode -> result): each class's p50 over alone, one bar per
    mode, with the target and 1.0 marked."""
    modes = list(mixed)
    classes = sorted(next(iter(mixed.values()))["by_class"], key=_size_then_steps)
    ratios = {(mode, name): mixed[mode]["by_class"][name]["p50_over_solo"] for mode in modes for name in classes}
    top = max(max(ratios.values()), MIXED_TARGET) * 1.15
    first = next(iter(mixed.values()))
    _frame(canvas, x0, y0, w, h, f"mixed, {first['load']:.0%} of {load_basis(mixed)} "
           f"({first['load'] * first['peak_per_s']:.2f}/s): class p50 / alone", top)
    for level, colour in ((1.0, "gray"), (MIXED_TARGET, "#d43b3b")):
        y = y0 + h - h * level / top
        canvas.line([(x0, y), (x0 + w, y)], fill=colour, width=1)
        canvas.text((x0 - 34, y - 6), f"{level:.1f}", fill=colour)
    group_w = w / len(classes)
    bar_w = group_w * 0.8 / len(modes)
    for g, name in enumerate(classes):
        left = x0 + g * group_w + group_w * 0.1
        for b, mode in enumerate(modes):
            value = ratios[mode, name]
            _bar(canvas, left + b * bar_w, bar_w, y0 + h, h * value / top, _colour(mode))
        steps, size = name.split(" steps ")
        canvas.text((left, y0 + h + 6), f"{steps} st", fill="black")
        canvas.text((left, y0 + h + 18), size, fill="black")
    _legend(canvas, x0, y0 + h + 36, [(_label(mode), _colour(mode)) for mode in modes])


def _size_then_steps(name: str) -> tuple[int, int]:  # "20 steps 512px"
    steps, size = name.removesuffix("px").split(" steps ")
    return int(size), int(steps)


def _colour(mode: str) -> str:
    return COLOURS.get(mode, "#444444")


def _label(mode: str) -> str:
    return {"step": "step (the default order)"}.get(mode, mode.replace("_", " "))


def _frame(canvas, x0: float, y0: float, w: float, h: float, title: str, top: float) -> None:
    canvas.rectangle([x0, y0, x0 + w, y0 + h], outline="gray")
    canvas.text((x0, y0 - 18), title, fill="black")
    canvas.text((x0 - 50, y0), f"{top:.0f}" if top >= 10 else f"{top:.1f}", fill="gray")


def _bar(canvas, left: float, width: float, bottom: float, height: float, colour: str, light: bool = False) -> None:
    fill = _lighter(colour) if light else colour
    canvas.rectangle([left + 1, bottom - height, left + width - 1, bottom], fill=fill)


def _lighter(colour: str) -> str:
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{(c + 2 * 255) // 3:02x}" for c in rgb)


def _legend(canvas, x: float, y: float, entries: list[tuple[str, str]]) -> None:
    for label, colour in entries:
        canvas.rectangle([x, y + 2, x + 10, y + 12], fill=colour)
        canvas.text((x + 14, y), label, fill="black")
        x += 14 + 7 * len(label) + 16


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    title = args.title or f"open loop, {report.get('preset', '?')} preset, {report.get('device', '?')}"
    plot(report, args.out, title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
