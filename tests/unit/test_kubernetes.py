"""deploy/kubernetes.yaml: valid against Kubernetes' own schemas, and in step
with the image (Dockerfile) and the launcher it runs. Its probes are sent to a
real server in tests/integration/test_kubernetes_probes.py and, while a stub
restarts, in tests/reliability/test_stub_restart.py."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
from triton_omni_tools.launcher import EXIT_TIMEOUT_S, STOP_TIMEOUT_S

from tests.support.probes import PROBES, container, resources, would_restart

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")  # an older cluster and a recent one


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_resource_is_valid_kubernetes(version):
    for kind, resource in resources().items():
        kubernetes_validate.validate(resource, version, strict=True)  # raises, naming the field
        assert kind in ("Deployment", "Service")


def test_the_ports_are_the_images_and_it_listens_beyond_localhost():
    dockerfile = (ROOT / "Dockerfile").read_text()
    exposed = {int(port) for port in re.search(r"^EXPOSE (.*)$", dockerfile, re.M).group(1).split()}
    assert {port["containerPort"] for port in container()["ports"]} == exposed
    assert '"--bind", "0.0.0.0"' in dockerfile  # the launcher's default, 127.0.0.1, would fail every probe


def test_probes_use_named_ports_of_the_container():
    names = {port["name"] for port in container()["ports"]}
    probes = {kind: container()[kind]["httpGet"] for kind in PROBES}
    assert all(probe["port"] in names for probe in probes.values()), probes
    assert probes["livenessProbe"]["path"] == "/v2/health/live"  # not ready: a stub restart must not kill the pod
    assert probes["readinessProbe"]["path"] == probes["startupProbe"]["path"] == "/v2/health/ready"


def test_the_grace_period_covers_the_launchers_stop():
    spec = resources()["Deployment"]["spec"]["template"]["spec"]
    pause = int(container()["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert EXIT_TIMEOUT_S < STOP_TIMEOUT_S
    assert spec["terminationGracePeriodSeconds"] > pause + STOP_TIMEOUT_S


def test_the_service_selects_the_pods_and_their_named_ports():
    deployment, service = resources()["Deployment"], resources()["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert {port["targetPort"] for port in service["spec"]["ports"]} == {port["name"] for port in container()["ports"]}


def volumes_by_mount() -> dict[str, dict]:
    """The pod's volumes, by the path the container mounts each at."""
    volumes = {volume["name"]: volume for volume in resources()["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    return {mount["mountPath"]: volumes[mount["name"]] for mount in container()["volumeMounts"]}


def test_shared_memory_is_a_memory_volume_at_dev_shm():
    assert volumes_by_mount()["/dev/shm"]["emptyDir"]["medium"] == "Memory"


def test_the_compile_caches_are_on_a_disk_volume_that_outlasts_the_container():
    """The image points torch.compile's and vLLM's caches into one folder; the manifest mounts a volume
    there, on disk (they grow to gigabytes), so a restarted container finds what the last one compiled."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    names = ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT")
    caches = [re.search(rf"{name}=(\S+)", dockerfile).group(1) for name in names]
    mounted = volumes_by_mount()
    for cache in caches:
        [volume] = [volume for path, volume in mounted.items() if cache.startswith(path.rstrip("/") + "/")]
        assert "persistentVolumeClaim" in volume or volume["emptyDir"].get("medium") != "Memory", volume


def test_liveness_allows_what_the_kubelet_allows():
    """The reliability tests' reading of its probes: five minutes of failures (30 x 10 s) restart."""
    assert not would_restart([(0.0, 200), (1.0, 0), (150.0, 503), (299.0, 0), (300.0, 200)])
    assert would_restart([(0.0, 200), (1.0, 0), (150.0, 503), (301.0, 0)])


def test_liveness_outlasts_a_restart_of_tritonserver():
    """The launcher's restarts (test_server_restart.py: ready again within 120 s) must not look dead."""
    probe = container()["livenessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 120 + 60
