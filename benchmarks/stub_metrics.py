"""What a custom metric update costs inside a real Triton stub, and whether
it holds the GIL meanwhile.

Each ``increment``, ``observe`` or ``set`` of a ``pb_utils`` metric is a
message to the server and back. The stubs send them from their response
thread, beside the responses (``triton/metrics.py``, ``Routed``), so their
cost is the response thread's. A throwaway model's ``initialize``
(``stub_probe.py``) times each kind of update alone, then again while a
pure-Python thread spins beside it. Printed per kind: microseconds per
update alone and beside the spinner, and the spinner's rate during the
updates as a share of its rate during ``time.sleep`` (which releases the
GIL). A share near 1 means the update releases the GIL while it waits for
the server; 0 means it holds it. The time beside the spinner is then mostly
the wait to take the GIL back (the interpreter's switch interval).

    .venv/bin/python benchmarks/stub_metrics.py [--calls 5000]
"""

from __future__ import annotations

import argparse

from stub_probe import EXECUTE, run_in_stub

MODEL = '''
import json
import threading
import time
import timeit

import numpy as np
import triton_python_backend_utils as pb_utils


def spinning_rate(work) -> tuple[float, float]:
    """(seconds ``work`` took, iterations per second of a Python loop beside it)."""
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        time.sleep(0.05)
        before, started = count[0], time.perf_counter()
        work()
        took, after = time.perf_counter() - started, count[0]
    finally:  # a failed update must not leave a spinning stub behind
        stop[0] = True
        thread.join()
    return took, (after - before) / took


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        calls = int(params["calls"])
        kind = pb_utils.MetricFamily
        # Families outlive their metrics (a family deleted first makes every update fail).
        self.families = [kind(name=f"probe_{n}", description=n, kind=k) for n, k in
                         (("histogram", kind.HISTOGRAM), ("counter", kind.COUNTER), ("gauge", kind.GAUGE))]
        histogram = self.families[0].Metric(labels={"probe": "1"}, buckets=[0.1, 1.0, 10.0])
        counter = self.families[1].Metric(labels={"probe": "1"})
        gauge = self.families[2].Metric(labels={"probe": "1"})
        updates = {"histogram observe": lambda: histogram.observe(0.5),
                   "counter increment": lambda: counter.increment(1),
                   "gauge set": lambda: gauge.set(1)}
        _, sleeping = spinning_rate(lambda: [time.sleep(0.001) for _ in range(200)])
        figures = {}
        for name, update in updates.items():
            alone = min(timeit.repeat(update, number=calls, repeat=3)) / calls
            took, rate = spinning_rate(lambda: [update() for _ in range(calls)])
            figures[name] = {"alone_us": 1e6 * alone, "beside_spinner_us": 1e6 * took / calls,
                             "spinner_share": rate / sleeping}
        _, busy = spinning_rate(lambda: sum(range(2_000_000)))
        figures["pure Python (holds the GIL)"] = {"spinner_share": busy / sleeping}
        with open(params["out"], "w") as f:
            json.dump(figures, f)
        self.metrics = (histogram, counter, gauge)

    def finalize(self):
        self.metrics = None  # before the families
        self.families = None
''' + EXECUTE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="updates per repeat of each kind")
    args = parser.parse_args()
    figures = run_in_stub("stub_metrics", MODEL, {"calls": args.calls})
    print(f"{'':<28} {'alone':>9} {'beside a busy thread':>21} {'its rate / asleep':>18}")
    for name, row in figures.items():
        alone = f"{row['alone_us']:7.1f} us" if "alone_us" in row else ""
        beside = f"{row['beside_spinner_us']:8.1f} us" if "beside_spinner_us" in row else ""
        print(f"{name:<28} {alone:>9} {beside:>21} {row['spinner_share']:17.2f}x")


if __name__ == "__main__":
    main()
