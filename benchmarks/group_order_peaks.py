"""Does a step-batching group order cost throughput? The mixed-traffic
closed-loop peak of each ``group_order``, measured in turns on one server.

``bench --open-loop`` measures a mode's peak once: on an H200 such single
measurements of one order ranged from 4.71 to 5.63 img/s, wider than any
difference between orders. Here one server loads the bench's copies of
``diffusion``, one per order (``step``: the default order; ``step_round_robin``,
``step_shortest_first``), warms each up, then measures their peaks in turns
(every order once per turn), so that drift hits all of them alike.
Printed: each turn's peak per order (img/s), and per order the median of the
turns after the first (the first still meets new batch shapes).

    .venv/bin/python benchmarks/group_order_peaks.py [--preset realistic] [--turns 4] [--rounds 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from triton_omni.demo_models import resolve_model
from triton_omni_tools.bench import PRESETS, openloop
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

SERVER_LOG = Path(".cache/group-order-peaks-server.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="realistic", choices=sorted(PRESETS))
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="times each client sends every class per measurement")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    resolve_model(preset.diffusion_model)
    SERVER_LOG.parent.mkdir(parents=True, exist_ok=True)
    classes = [openloop.ImageClass(s, z) for s in preset.mixed_steps for z in preset.mixed_sizes]
    models = {mode: model for mode, model in openloop.MIXED_MODES.items() if mode.startswith("step")}
    with tempfile.TemporaryDirectory(prefix="omni-group-orders-") as tmp:
        options = ServerOptions(model_repositories=openloop.repository(preset, Path(tmp)), http_port=free_port(),
                                grpc_port=free_port(), metrics_port=free_port(), log_file=SERVER_LOG,
                                model_control_mode="explicit", load_models=sorted(models.values()))
        with TritonServer(options) as server:
            for model in models.values():
                openloop.warm_up(server.grpc_url, preset, model, classes, preset.max_batch_size)
            peaks: dict[str, list[float]] = {order: [] for order in models}
            for turn in range(args.turns):
                for order, model in models.items():
                    peak = openloop.closed_loop_peak(server.grpc_url, preset, model, classes,
                                                     preset.max_batch_size, rounds=args.rounds)
                    peaks[order].append(peak)
                    print(f"turn {turn} {order:<20} {peak:6.3f} img/s", flush=True)
    print("\nmedian of turns 2..: " + ", ".join(f"{order} {statistics.median(values[1:] or values):.2f}"
                                                for order, values in peaks.items()))


if __name__ == "__main__":
    main()
