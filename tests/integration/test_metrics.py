"""After a mixed run, /metrics serves every custom metric documented in docs/metrics.md, with counts."""

from __future__ import annotations

import re
import urllib.request

import pytest
from triton_omni_client import OmniClient, OmniError
from triton_omni_tools.launcher import PROJECT_ROOT

from tests.integration.test_pipelines import ensemble


def documented_metrics() -> dict[str, str]:
    """name -> kind, from the table in docs/metrics.md."""
    table = (PROJECT_ROOT / "docs" / "metrics.md").read_text()
    return dict(re.findall(r"^\| `(omni_\w+)` \| (counter|gauge|histogram) \|", table, flags=re.M))


def test_every_custom_metric_is_served_with_counts_after_a_mixed_run(server):
    client = OmniClient(server.grpc_url)
    list(client.generate("hello", modalities=["text", "image"], max_tokens=4, num_inference_steps=2))
    ensemble(server.http_url, "http", "a fox", num_inference_steps=2)
    with pytest.raises(OmniError):  # refused by admission, for omni_rejected_requests_total
        list(client.generate("a fox", modalities=["image"], model="omni_small_budget", num_inference_steps=2))

    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    metrics = documented_metrics()
    assert len(metrics) >= 15
    for name, kind in metrics.items():
        sample = name + ("_count" if kind == "histogram" else "")
        values = [float(v) for v in re.findall(rf"^{sample}{{[^}}]*}} (\S+)$", text, flags=re.M)]
        assert values, f"{name} is not served"
        if kind != "gauge":
            assert sum(values) > 0, f"{name} has no counts"
        assert re.search(rf'^{sample}{{[^}}]*model="[^"]+"[^}}]*version="1"', text, flags=re.M), \
            f"{name} lacks its model/version labels"
