"""The probes of deploy/kubernetes.yaml pass on a serving server, sent as the
kubelet sends them, and the metrics deploy/pools' autoscalers read are on its
metrics port. What the probes say while a stub restarts is checked in
tests/reliability/test_stub_restart.py."""

from __future__ import annotations

import urllib.request

import pytest
import yaml

from tests.support.probes import MANIFEST, PROBES, kubelet_get, manifest_probe, passed


@pytest.mark.parametrize("kind", PROBES)
def test_a_serving_server_passes_the_probe(http_url, kind):
    get = manifest_probe(kind)["httpGet"]
    assert get["port"] == "http"  # the server's HTTP port
    status = kubelet_get(http_url, kind)
    assert passed(status), f"{kind} {get['path']}: {status}"


def test_the_pools_autoscalers_read_series_a_serving_server_exports(server):
    """deploy/pools' HorizontalPodAutoscalers scale on these names (through prometheus-adapter's
    rules): a serving server's metrics port has a series of each, before any load."""
    exported = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    pools = MANIFEST.parent / "pools"
    names = [metric["pods"]["metric"]["name"]
             for name in ("stages.yaml", "front.yaml") for doc in yaml.safe_load_all((pools / name).read_text())
             if doc["kind"] == "HorizontalPodAutoscaler" for metric in doc["spec"]["metrics"]]
    assert sorted(names) == ["omni_diffusion_requests_in_flight", "omni_scheduler_requests_in_flight"]
    for name in names:
        assert any(line.startswith(name + "{") for line in exported.splitlines()), f"no {name} series on /metrics"
