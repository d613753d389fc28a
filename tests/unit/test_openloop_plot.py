"""The open-loop report's plot, drawn from a saved report (as benchmarks/records/ keeps them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image
from triton_omni_tools.bench import openloop, openloop_plot


def _mixed(peak_of: str | None) -> dict:
    result = {"load": 0.5, "peak_per_s": 6.3, "by_class": {name: {"p50_over_solo": ratio} for name, ratio in
                                                          (("10 steps 512px", 1.4), ("50 steps 384px", 1.7))}}
    return {mode: result | ({"peak_of": peak_of} if peak_of else {}) for mode in ("step", "step_round_robin")}


MIXED = {"by_request_peak": _mixed("request"), "by_own_peak": _mixed("step")}
OLD_MIXED = _mixed(None)  # reports before the two readings: one dict of modes, each at its own peak
LOADS = {"0.5": {mode: {"p50_ms": 400.0, "p99_ms": 1000.0} for mode in ("request", "step")}}


@pytest.mark.parametrize(("report", "panels"), [({"mixed": MIXED}, 2),
                                                ({"loads": LOADS, "peak_per_s": 7.0, "mixed": MIXED}, 3),
                                                ({"mixed": {"by_request_peak": _mixed("request"),
                                                            "by_own_peak": {}}}, 1),
                                                ({"loads": LOADS, "peak_per_s": 7.0, "mixed": OLD_MIXED}, 2)])
def test_one_panel_per_part_of_the_report(tmp_path, report, panels):
    openloop_plot.main([str(_saved(tmp_path, report)), str(tmp_path / "plot.png")])
    with Image.open(tmp_path / "plot.png") as image:
        assert image.width == panels * openloop_plot.PANEL_W


def test_an_old_report_reads_as_each_mode_at_its_own_peak():
    assert openloop_plot.mixed_readings({"mixed": OLD_MIXED}) == {"by_own_peak": OLD_MIXED}
    assert openloop_plot.mixed_readings({"mixed": None}) == {}


def test_a_report_with_nothing_to_plot_is_refused(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        openloop_plot.plot({"loads": {}, "mixed": None}, tmp_path / "plot.png", "empty")


def test_classes_run_by_size_then_steps():
    names = ["50 steps 384px", "10 steps 512px", "10 steps 384px"]
    assert sorted(names, key=openloop_plot._size_then_steps) == ["10 steps 384px", "50 steps 384px", "10 steps 512px"]


def _saved(tmp_path, report: dict):
    path = tmp_path / "open-loop.json"
    path.write_text(json.dumps(report))
    return path


RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "records" / "data"


@pytest.mark.parametrize("name", ["benchmarks-realistic-h200-open-loop.json",
                                  "benchmarks-realistic-h200-mixed-two-readings-2026-11-24.json",
                                  "benchmarks-tiny-cpu-mixed-group-order-2026-11-24.json"])
def test_the_reports_kept_in_the_records_still_print_and_plot(tmp_path, capsys, name):
    """Reports from before and after the two readings of mixed traffic's load."""
    report = json.loads((RECORDS / name).read_text())
    openloop.table(report)
    assert "worst" in capsys.readouterr().out
    openloop_plot.plot(report, tmp_path / "plot.png", name)
    with Image.open(tmp_path / "plot.png") as image:
        assert image.width >= openloop_plot.PANEL_W
