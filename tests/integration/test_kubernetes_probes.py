"""The probes of deploy/kubernetes.yaml pass on a serving server, sent as the
kubelet sends them. What they say while a stub restarts is checked in
tests/reliability/test_stub_restart.py."""

from __future__ import annotations

import pytest

from tests.support.probes import PROBES, kubelet_get, manifest_probe, passed


@pytest.mark.parametrize("kind", PROBES)
def test_a_serving_server_passes_the_probe(http_url, kind):
    get = manifest_probe(kind)["httpGet"]
    assert get["port"] == "http"  # the server's HTTP port
    status = kubelet_get(http_url, kind)
    assert passed(status), f"{kind} {get['path']}: {status}"
