"""The HTTP probes of deploy/kubernetes.yaml, sent as the kubelet sends them:
a GET of the probe's path, success being a status from 200 to 399."""

from __future__ import annotations

import functools
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes.yaml"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@functools.cache
def resources() -> dict[str, dict]:
    """The manifest's resources by kind, read once (the prober asks several times a second)."""
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def container() -> dict:
    """The Deployment's one container."""
    return resources()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def manifest_probe(kind: str) -> dict:
    """The container's probe ``kind``: ``httpGet``, ``periodSeconds``, ``timeoutSeconds``, ..."""
    return container()[kind]


def kubelet_get(http_url: str, kind: str) -> int:
    """The probe's HTTP status (0: no answer within its ``timeoutSeconds``, 1 s unless set)."""
    probe = manifest_probe(kind)
    request = urllib.request.Request(f"http://{http_url}{probe['httpGet']['path']}",
                                     headers={"User-Agent": "kube-probe/1.33"})
    try:
        with urllib.request.urlopen(request, timeout=probe.get("timeoutSeconds", 1)) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def passed(status: int) -> bool:
    return 200 <= status < 400


def would_restart(seen: list[tuple[float, int]], kind: str = "livenessProbe") -> bool:
    """Whether probes failing as in ``seen`` (time, status) for as long as the kubelet allows
    (``failureThreshold`` periods in a row) would have made it act: restart, for liveness."""
    probe = manifest_probe(kind)
    allowed_s = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    failing_since = None
    for at, status in seen:
        if passed(status):
            failing_since = None
        elif failing_since is None:
            failing_since = at
        elif at - failing_since >= allowed_s:
            return True
    return False


class Prober:
    """Sends the readiness and liveness probes every ``period_s`` (more often than the kubelet,
    so as to see short changes) on a thread, keeping every (time, status)."""

    def __init__(self, http_url: str, period_s: float = 0.2):
        self.http_url, self.period_s = http_url, period_s
        self.seen: dict[str, list[tuple[float, int]]] = {"readinessProbe": [], "livenessProbe": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def statuses(self, kind: str) -> list[int]:
        return [status for _, status in self.seen[kind]]

    def _run(self) -> None:
        while not self._stop.is_set():
            for kind, seen in self.seen.items():
                seen.append((time.monotonic(), kubelet_get(self.http_url, kind)))
            time.sleep(self.period_s)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
