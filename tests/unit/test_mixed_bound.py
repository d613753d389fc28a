"""benchmarks/mixed_bound.py, the model of the step engine under mixed traffic:
it runs, and it agrees with what it was built from (a request alone takes its
measured time alone; the closed-loop peak is the H200's)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mixed_bound.py"
spec = importlib.util.spec_from_file_location("mixed_bound", SCRIPT)
mixed_bound = sys.modules["mixed_bound"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
spec.loader.exec_module(mixed_bound)


def test_a_request_alone_takes_its_time_alone():
    # one arrival a minute: every request runs alone
    ratios = mixed_bound.simulate("most_behind", rate=1 / 60, count=60, seed=1)
    assert len(ratios) == 6 and all(r == pytest.approx(1.0, abs=0.01) for r in ratios.values()), ratios


def test_the_models_peak_is_the_measured_one():
    assert 6.0 < mixed_bound.peak("most_behind") < 7.0  # 6.3 to 6.6 img/s measured on an H200


@pytest.mark.parametrize("order", mixed_bound.ORDERS)
def test_every_order_serves_every_request(order):
    ratios = mixed_bound.simulate(order, rate=2.5, count=200, seed=3)
    assert len(ratios) == 6 and all(r >= 0.99 for r in ratios.values()), ratios
