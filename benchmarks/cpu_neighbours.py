"""How fast each CPU of this host runs Python, alone and beside one busy CPU.

vLLM's engine core steps as fast as the CPU under it (docs/benchmarks.md,
"Fourteenth pass"), so a benchmark that compares two engines is only as
fair as their CPUs are alike. On a virtual machine they need not be: its
CPUs may be threads of cores that other CPUs of the machine, or other
guests, also run on. This measures it. First each CPU alone: a fixed loop of
pure Python pinned to it, the best of ``--reps`` runs, in ms. Then, for each
CPU ``j`` in turn kept busy by a spinning process, every other CPU again:
those whose loop took more than ``--slower`` times its time alone share
something with ``j``. On dedicated cores that list stays empty.

    python benchmarks/cpu_neighbours.py [--loops 300000] [--reps 5] [--slower 1.15]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time


def loop(n: int) -> float:
    """Seconds for ``n`` iterations of integer arithmetic (no memory traffic to speak of)."""
    start, x = time.perf_counter(), 0
    for i in range(n):
        x += i * i % 7
    return time.perf_counter() - start


def timed(cpu: int, loops: int, reps: int) -> float:
    os.sched_setaffinity(0, {cpu})
    loop(loops // 6)  # settle on the CPU
    return min(loop(loops) for _ in range(reps))


def spin(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        pass


def neighbours(cpus: list[int], loops: int, reps: int, slower: float) -> tuple[dict[int, float], dict[int, dict]]:
    """Each CPU's loop time alone, and for each busy CPU the others it slowed by more than ``slower``x."""
    alone = {cpu: timed(cpu, loops, reps) for cpu in cpus}
    slowed = {}
    context = multiprocessing.get_context("spawn")
    for busy in cpus:
        stop = context.Event()
        spinner = context.Process(target=spin, args=(busy, stop), daemon=True)
        spinner.start()
        time.sleep(0.05)
        ratios = {cpu: timed(cpu, loops, max(1, reps // 2)) / alone[cpu] for cpu in cpus if cpu != busy}
        stop.set()
        spinner.join()
        slowed[busy] = {cpu: ratio for cpu, ratio in ratios.items() if ratio > slower}
    return alone, slowed


def report(alone: dict[int, float], slowed: dict[int, dict]) -> str:
    fastest = min(alone.values())
    rows = ["alone, ms (x the fastest): " + "  ".join(
        f"{cpu}:{1000 * t:.1f} ({t / fastest:.2f})" for cpu, t in alone.items())]
    for busy, others in slowed.items():
        listed = ", ".join(f"{cpu} x{ratio:.2f}" for cpu, ratio in others.items()) or "none"
        rows.append(f"CPU {busy} busy slows: {listed}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=300_000, help="iterations per timed loop (default 300000)")
    parser.add_argument("--reps", type=int, default=5, help="timed loops per CPU alone, the best kept (default 5)")
    parser.add_argument("--slower", type=float, default=1.15,
                        help="list a CPU under a busy one when its loop takes this many times its time alone")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    print(report(*neighbours(cpus, args.loops, args.reps, args.slower)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
