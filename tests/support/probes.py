"""The HTTP probes of deploy/kubernetes.yaml, sent as the kubelet sends them:
a GET of the probe's path, success being a status from 200 to 399."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes.yaml"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def manifest_probe(kind: str) -> dict:
    """The ``httpGet`` of the Deployment's probe ``kind``."""
    deployment = next(doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0][kind]["httpGet"]


def kubelet_get(http_url: str, path: str) -> int:
    """The probe's HTTP status (0: no answer within the kubelet's default 1 s timeout)."""
    request = urllib.request.Request(f"http://{http_url}{path}", headers={"User-Agent": "kube-probe/1.33"})
    try:
        with urllib.request.urlopen(request, timeout=1) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def passed(status: int) -> bool:
    return 200 <= status < 400


class Prober:
    """Sends the readiness and liveness probes every ``period_s`` on a thread, keeping every status."""

    def __init__(self, http_url: str, period_s: float = 0.2):
        self.http_url, self.period_s = http_url, period_s
        self.seen: dict[str, list[int]] = {"readinessProbe": [], "livenessProbe": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for kind, statuses in self.seen.items():
                statuses.append(kubelet_get(self.http_url, manifest_probe(kind)["path"]))
            time.sleep(self.period_s)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
