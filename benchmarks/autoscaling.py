"""The pools' autoscaling rules (deploy/pools) against a real server's metrics: Locust ramps the load
up and down (`OMNI_RAMP`, loadtest/locustfile.py) while this script reads, every half second, what
each HorizontalPodAutoscaler reads through prometheus-adapter: the sum of its metric's series on
the pod's metrics port (the adapter's `sum(...) by (pod)`). With one pod, the pool's average is
that pod's value.

Prints, for each autoscaler, its metric and target, the highest value, when it first and last
stood above the target, and the mean of the last ten seconds; exits non-zero unless every metric
went above its target under the peak and came back below it once the load fell. Writes the
samples (CSV) and a plot (SVG: each metric, its target, and Locust's user count) to --out.

One server holds every stage here (the demo models on a CPU), so both pools' metrics move on one
pod: `omni_diffusion_requests_in_flight` (stage pool, target 4) with `text_to_image` and `omni`
requests, `omni_scheduler_requests_in_flight` (front pool, target 32) with `omni`'s.

    .venv/bin/python benchmarks/autoscaling.py [--ramp 2@20,64@40,2@40] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml
from triton_omni.demo_models import build_all
from triton_omni_tools.launcher import PROJECT_ROOT, ServerOptions, TritonServer, free_port

sys.path.insert(0, str(PROJECT_ROOT))  # loadtest/ is a folder of the checkout, not an installed package
from loadtest.run import run_locust

POOLS = PROJECT_ROOT / "deploy" / "pools"
SAMPLE_S = 0.5
SETTLED_S = 10.0  # the end of the run whose mean must be back below the target


@dataclass(frozen=True)
class Rule:
    autoscaler: str
    metric: str
    target: float


def rules(pools: Path = POOLS) -> list[Rule]:
    """Every per-pod metric rule of the pools' HorizontalPodAutoscalers, as the manifests say."""
    kustomization = yaml.safe_load((pools / "kustomization.yaml").read_text())
    found = []
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((pools / name).read_text()):
            if doc and doc["kind"] == "HorizontalPodAutoscaler":
                for metric in doc["spec"]["metrics"]:
                    pods = metric["pods"]
                    found.append(Rule(doc["metadata"]["name"], pods["metric"]["name"],
                                      float(pods["target"]["averageValue"])))
    return found


def pod_value(text: str, metric: str) -> float:
    """What the adapter's ``sum(<metric>) by (pod)`` gives for one pod's exposition."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((metric + "{", metric + " ")))


class Sampler(threading.Thread):
    """Every SAMPLE_S, each rule's metric from the server's metrics port, with the time."""

    def __init__(self, metrics_url: str, metrics: list[str]):
        super().__init__(daemon=True)
        self.metrics_url, self.metrics = metrics_url, metrics
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(SAMPLE_S):
            try:
                text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
            except OSError:
                continue  # a missed sample; the next one comes
            self.samples.append((time.time(), {m: pod_value(text, m) for m in self.metrics}))


@dataclass(frozen=True)
class Verdict:
    target: float
    highest: float
    first_above_s: float | None
    last_above_s: float | None
    settled: float  # the mean of the run's last SETTLED_S

    @property
    def crossed_and_back(self) -> bool:
        return self.first_above_s is not None and self.settled < self.target


def judge(times: list[float], values: list[float], target: float) -> Verdict:
    """Above the target: strictly more (the autoscaler adds pods past its target)."""
    above = [t for t, v in zip(times, values, strict=True) if v > target]
    tail = [v for t, v in zip(times, values, strict=True) if t >= times[-1] - SETTLED_S]
    return Verdict(target, max(values), above[0] if above else None, above[-1] if above else None,
                   sum(tail) / len(tail))


def at(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def users_over_time(history: Path) -> list[tuple[float, int]]:
    """Locust's user count by unix time, from its ``_stats_history.csv`` (one row a second)."""
    with history.open() as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] == "Aggregated"]
    return [(float(r["Timestamp"]), int(r["User Count"])) for r in rows]


WIDTH, PANEL, LEFT, PAD = 720, 220, 60, 30  # the plot's width, a panel's height, margins


def panel(top: float, span: float, metric: str, values: list[float], times: list[float], target: float,
          users: list[tuple[float, int]]) -> list[str]:
    """One metric's panel: its values (blue), its target (red, dashed), the users (grey, scaled)."""
    highest = max(*values, target) or 1.0
    most_users = max((u for _, u in users), default=1) or 1

    def x(t: float) -> float:
        return LEFT + (WIDTH - LEFT - 20) * t / span

    def y(v: float, scale: float) -> float:
        return top + PANEL - PANEL * v / (scale * 1.15)

    line = " ".join(f"{x(t):.1f},{y(v, highest):.1f}" for t, v in zip(times, values, strict=True))
    crowd = " ".join(f"{x(t):.1f},{y(u, most_users):.1f}" for t, u in users)
    return [f'<text x="{LEFT}" y="{top - 8}">{metric} (summed on the pod), its target {target:g} (red); '
            f'grey: Locust users (up to {most_users})</text>',
            f'<rect x="{LEFT}" y="{top}" width="{WIDTH - LEFT - 20}" height="{PANEL}" fill="none" stroke="#888"/>',
            f'<polyline points="{crowd}" fill="none" stroke="#aaa" stroke-width="1.5"/>',
            f'<line x1="{LEFT}" x2="{WIDTH - 20}" y1="{y(target, highest):.1f}" y2="{y(target, highest):.1f}" '
            'stroke="red" stroke-dasharray="6,4"/>',
            f'<polyline points="{line}" fill="none" stroke="#1f5fbf" stroke-width="1.5"/>',
            f'<text x="{LEFT - 6}" y="{y(highest, highest) + 4:.1f}" text-anchor="end">{highest:.0f}</text>',
            f'<text x="{LEFT - 6}" y="{top + PANEL + 4}" text-anchor="end">0</text>',
            f'<text x="{WIDTH - 20}" y="{top + PANEL + 14}" text-anchor="end">{span:.0f} s</text>']


def svg(times: list[float], series: dict[str, list[float]], targets: dict[str, float],
        users: list[tuple[float, int]]) -> str:
    """A panel per metric, one under the other."""
    height = PAD + len(series) * (PANEL + PAD)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" '
           'font-size="11"><rect width="100%" height="100%" fill="white"/>']
    for k, (metric, values) in enumerate(series.items()):
        out += panel(PAD + k * (PANEL + PAD), max(times[-1], 1.0), metric, values, times, targets[metric], users)
    return "\n".join([*out, "</svg>\n"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ramp", default="2@20,64@40,2@40", help="USERS@SECONDS phases (OMNI_RAMP)")
    parser.add_argument("--weights", default="0,1,2", help="ar,text_to_image,omni task weights (OMNI_WEIGHTS)")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / ".cache" / "autoscaling")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    build_all()
    wanted = rules()
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            log_file=args.out / "server.log")
    with TritonServer(options) as server:
        sampler = Sampler(server.metrics_url, [rule.metric for rule in wanted])
        sampler.start()
        code = run_locust(server.http_url, server.grpc_url, args.out / "locust", users=1, run_time="1h",
                          extra_env={"OMNI_RAMP": args.ramp, "OMNI_WEIGHTS": args.weights,
                                     "OMNI_TIMEOUT_S": "600"})  # queued for minutes at the peak, not failed
        time.sleep(SETTLED_S)  # the load gone: what the autoscaler then reads
        sampler.stopped.set()
        sampler.join()
    start = sampler.samples[0][0]
    times = [t - start for t, _ in sampler.samples]
    series = {rule.metric: [values[rule.metric] for _, values in sampler.samples] for rule in wanted}
    users = [(t - start, u) for t, u in users_over_time(args.out / "locust_stats_history.csv")]
    with (args.out / "samples.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seconds", *series])
        writer.writerows([round(t, 2), *(series[m][i] for m in series)] for i, t in enumerate(times))
    (args.out / "autoscaling.svg").write_text(svg(times, series, {r.metric: r.target for r in wanted}, users))
    print(f"\nramp {args.ramp} (users@seconds), weights ar,text_to_image,omni {args.weights}; Locust exit {code}")
    print(f"{'autoscaler':<20}{'metric':<36}{'target':>7}{'highest':>9}{'above from':>12}{'to':>8}"
          f"{'last 10 s':>11}  crossed and back")
    ok = True
    for rule in wanted:
        verdict = judge(times, series[rule.metric], rule.target)
        ok &= verdict.crossed_and_back
        print(f"{rule.autoscaler:<20}{rule.metric:<36}{rule.target:>7g}{verdict.highest:>9.1f}"
              f"{at(verdict.first_above_s):>12}{at(verdict.last_above_s):>8}{verdict.settled:>11.2f}  "
              f"{'yes' if verdict.crossed_and_back else 'NO'}")
    print(f"samples: {args.out / 'samples.csv'}; plot: {args.out / 'autoscaling.svg'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
