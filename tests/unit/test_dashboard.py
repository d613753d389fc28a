"""The Grafana dashboard only queries metrics that exist."""

from __future__ import annotations

import json
import re

from triton_omni_tools.launcher import PROJECT_ROOT

from tests.support.server import documented_metrics

TRITON_METRICS = {"nv_inference_request_success", "nv_inference_request_failure", "nv_inference_queue_duration_us",
                  "nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def test_every_queried_metric_is_documented_or_triton_own():
    dashboard = json.loads((PROJECT_ROOT / "deploy" / "grafana-dashboard.json").read_text())
    documented = documented_metrics()
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\b((?:omni|nv)_\w+)", target["expr"])}
    assert queried
    for name in queried:
        base = next((name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
        assert base in documented or name in TRITON_METRICS, name
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
