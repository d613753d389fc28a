"""benchmarks/autoscaling.py judges the pools' autoscalers by what their manifests say and by what
prometheus-adapter would read from a pod: these are its rules, its reading of a pod's exposition,
and its verdict (crossed the target under load, back below it once the load fell)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def autoscaling(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("autoscaling")


def test_the_rules_are_the_manifests_autoscalers(autoscaling):
    assert {(r.autoscaler, r.metric, r.target) for r in autoscaling.rules()} == {
        ("triton-omni-stages", "omni_diffusion_requests_in_flight", 4.0),
        ("triton-omni-front", "omni_scheduler_requests_in_flight", 32.0)}


def test_a_pods_value_sums_the_metrics_series_and_nothing_else(autoscaling):
    exposition = "\n".join([
        "# HELP omni_diffusion_requests_in_flight Requests the diffusion stage is working on",
        'omni_diffusion_requests_in_flight{model="diffusion",instance="0"} 3',
        'omni_diffusion_requests_in_flight{model="diffusion",instance="1"} 2.5',
        'omni_diffusion_requests_in_flight_peak{model="diffusion"} 9',
        'omni_scheduler_requests_in_flight{model="omni"} 7'])
    assert autoscaling.pod_value(exposition, "omni_diffusion_requests_in_flight") == 5.5
    assert autoscaling.pod_value(exposition, "omni_scheduler_requests_in_flight") == 7
    assert autoscaling.pod_value(exposition, "omni_nothing") == 0


@pytest.mark.parametrize(("values", "crossed_and_back"), [
    ([0, 1, 6, 9, 5, 2, 0, 0], True),
    ([0, 1, 4, 4, 2, 0, 0, 0], False),  # at the target, never past it: no pod added
    ([0, 1, 6, 9, 9, 9, 8, 8], False),  # still above at the end
])
def test_the_verdict(autoscaling, monkeypatch, values, crossed_and_back):
    monkeypatch.setattr(autoscaling, "SETTLED_S", 2.0)
    times = [float(t) for t in range(len(values))]
    verdict = autoscaling.judge(times, values, 4.0)
    assert verdict.crossed_and_back is crossed_and_back
    assert verdict.highest == max(values)
