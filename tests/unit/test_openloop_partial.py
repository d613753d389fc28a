"""`bench --open-loop` saves its report after every point, so that a run cut short keeps what it
measured (the clients and the server replaced by stand-ins: this checks the bookkeeping only)."""

from __future__ import annotations

import copy

import pytest
from triton_omni_tools.bench import PRESETS, openloop


class StopHere(Exception):
    pass


@pytest.fixture
def stand_ins(monkeypatch):
    """Every measurement answers at once; a schedule returns one request of each class it was given."""
    class Sender:
        def __init__(self, url, preset):
            pass

        def close(self):
            pass

    def run_schedule(sender, model, arrivals, classes):
        by_class = {image.name: {"p50_ms": 10.0, "p99_ms": 20.0, "requests": 1} for image in classes}
        return {"requests": len(classes), "per_s": 1.0, "p50_ms": 10.0, "p99_ms": 20.0, "by_class": by_class}

    monkeypatch.setattr(openloop, "ImageSender", Sender)
    monkeypatch.setattr(openloop, "warm_up", lambda *args: None)
    monkeypatch.setattr(openloop, "closed_loop_peak", lambda *args, **kwargs: 4.0)
    monkeypatch.setattr(openloop, "solo_latency", lambda *args: 5.0)
    monkeypatch.setattr(openloop, "run_schedule", run_schedule)


def test_the_report_is_saved_after_every_point(stand_ins):
    saved: list[dict] = []
    report = {"loads": {}, "mixed": None}
    openloop.measure("url", PRESETS["tiny"], (0.5, 0.8), 6, ("request", "step"), report,
                     lambda: saved.append(copy.deepcopy(report)))
    # 2 loads x 2 modes, then mixed: 2 modes at request batching's peak, 1 step mode at its own
    assert len(saved) == 4 + 2 + 1
    assert list(saved[0]["loads"][0.5]) == ["request"]
    assert saved[-1] == report and list(report["mixed"]["by_own_peak"]) == ["step"]
    assert report["mixed"]["by_request_peak"]["step"]["worst_p50_over_solo"] == 2.0  # 10 ms over 5 alone


def test_a_run_cut_short_keeps_the_points_before_the_cut(stand_ins, monkeypatch):
    calls = []

    def cut_on_the_third(*args):
        calls.append(args)
        if len(calls) == 3:
            raise StopHere
        return {"requests": 1, "per_s": 1.0, "p50_ms": 10.0, "p99_ms": 20.0, "by_class": {}}

    monkeypatch.setattr(openloop, "run_schedule", cut_on_the_third)
    saved: list[dict] = []
    report = {"loads": {}, "mixed": None}
    with pytest.raises(StopHere):
        openloop.measure("url", PRESETS["tiny"], (0.5, 0.8), 6, (), report,
                         lambda: saved.append(copy.deepcopy(report)))
    assert len(saved) == 2  # both modes at 50 %; the cut came in the first run at 80 %
    assert list(saved[-1]["loads"]) == [0.5] and list(saved[-1]["loads"][0.5]) == ["request", "step"]
