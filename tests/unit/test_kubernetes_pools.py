"""deploy/pools: the stage pool and the front pool, each valid against Kubernetes' own schemas and
wired to the other: the front forwards exactly the models the stage pods load, to the stage
Service's name and gRPC port, through a headless Service (every pod's address, for round robin);
each pool has its PodDisruptionBudget and an autoscaler on a metric the adapter's rules serve and
the stages export; the probes are the single-server manifest's, and each grace period covers the
launcher's stop (the stage pool's longer drain of its denoising included)."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from triton_omni_tools.launcher import EXIT_TIMEOUT_S, UNLOAD_S
from triton_omni_tools.remote import parse

from tests.support.probes import container as single_server_container
from tests.support.probes import resources as single_server_resources

ROOT = Path(__file__).resolve().parents[2]
POOLS = ROOT / "deploy" / "pools"
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")


def documents() -> list[dict]:
    kustomization = yaml.safe_load((POOLS / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((POOLS / name).read_text())]


def of_pool(kind: str, component: str) -> dict:
    [doc] = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == f"triton-omni-{component}"]
    return doc


def container(component: str) -> dict:
    return of_pool("Deployment", component)["spec"]["template"]["spec"]["containers"][0]


def single_server_pod() -> dict:
    return single_server_resources()["Deployment"]["spec"]["template"]["spec"]


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args) if arg == flag]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_resource_is_valid_kubernetes(version):
    kinds = []
    for doc in documents():
        kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field
        kinds.append(doc["kind"])
    assert sorted(kinds) == sorted(["Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"] * 2)


def test_the_front_forwards_what_the_stage_pods_load_to_their_headless_service():
    stage_args, front_args = container("stages")["args"], container("front")["args"]
    loaded = flag_values(stage_args, "--load-model")
    service = of_pool("Service", "stages")
    assert service["spec"]["clusterIP"] == "None"  # every pod's address: each request round robin
    grpc_port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc"]
    forwarded = dict(parse(spec) for spec in flag_values(front_args, "--remote"))
    assert sorted(forwarded) == sorted(loaded) == ["ar_encoder", "diffusion"]
    assert set(forwarded.values()) == {f"dns:///{service['metadata']['name']}:{grpc_port}"}


@pytest.mark.parametrize("component", ["stages", "front"])
def test_each_pool_has_its_service_budget_and_autoscaler_on_its_pods(component):
    deployment = of_pool("Deployment", component)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert of_pool("Service", component)["spec"]["selector"].items() <= labels.items()
    assert of_pool("PodDisruptionBudget", component)["spec"]["selector"]["matchLabels"].items() <= labels.items()
    autoscaler = of_pool("HorizontalPodAutoscaler", component)["spec"]
    assert autoscaler["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert autoscaler["minReplicas"] >= 1 and autoscaler["maxReplicas"] > autoscaler["minReplicas"]


def test_the_autoscalers_metrics_are_served_by_the_adapter_and_exported_by_the_stages():
    adapter = yaml.safe_load((POOLS / "prometheus-adapter-values.yaml").read_text())
    served = {re.match(r"(\w+)\{", rule["seriesQuery"]).group(1) for rule in adapter["rules"]["custom"]}
    metrics = (ROOT / "docs" / "metrics.md").read_text()
    for component in ("stages", "front"):
        [metric] = of_pool("HorizontalPodAutoscaler", component)["spec"]["metrics"]
        name = metric["pods"]["metric"]["name"]
        assert name in served and f"| `{name}` | gauge |" in metrics


def test_the_stage_pool_drains_longer_than_a_denoising_request():
    assert int(flag_values(container("stages")["args"], "--exit-timeout-secs")[0]) >= 60


@pytest.mark.parametrize("component", ["stages", "front"])
def test_probes_shared_memory_and_grace_cover_the_launchers_stop(component):
    pod = of_pool("Deployment", component)["spec"]["template"]["spec"]
    ours, single = container(component), single_server_container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        assert ours[probe] == single[probe], probe
    pause = int(ours["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = int(next(iter(flag_values(ours["args"], "--exit-timeout-secs")), EXIT_TIMEOUT_S))
    assert pod["terminationGracePeriodSeconds"] > pause + drain + UNLOAD_S  # the launcher's stop, all of it
    assert ours["volumeMounts"] == single["volumeMounts"]  # shared memory, the compile caches
    assert pod["volumes"] == single_server_pod()["volumes"]
    assert ours["args"][:6] == ["omni-triton", "serve", "--server", "system", "--bind", "0.0.0.0"]
