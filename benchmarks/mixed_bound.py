"""How close can any group order get to issue 12's mixed-traffic target? A model, not a measurement.

The target: under mixed traffic (10/20/50 steps at 384 and 512 pixels, one
class in six each, Poisson arrivals at 50 % of the peak), no class's p50 above
1.5x its time alone. On an H200 the step engine's best order reached 1.59 to
1.64 (docs/benchmarks.md). This script replays that traffic through a model
of the step engine whose costs come from the same H200's measurements, to
ask whether the order is what is missing, or the GPU's cost curve:

- ``round_robin``, ``shortest_first``, ``most_behind``: the engine's orders,
  one group (size) per step, as it runs them;
- ``one_pass``: a make-believe engine in which both sizes share every
  forward pass (a step of n512 and n384 requests costs what n512 + 0.82 n384
  requests of 512 cost);
- ``one_pass_K``: the same, but each step takes only the K requests
  furthest behind their time alone (a cap that trades batching for
  priority).

The model (H200, realistic preset, CFG: two rows a request), from
docs/benchmarks.md:
- a step of n requests at 512 costs S(n), from the closed-loop direct
  curve (3.66, 5.29, 6.44, 7.14, 7.48 img/s at 1, 2, 4, 8, 16 requests,
  20 steps) less each request's fixed cost, interpolated linearly;
- a step at 384 costs 0.82 of one at 512 (the solo times' ratio);
- each request's fixed cost (prompt encoding, decode, delivery) is taken
  from the solo times (10/20/50 steps: 152/272/630 ms at 512, 121/220/512 at
  384): 32 ms at 512, 23 at 384, charged to the GPU when it finishes;
- at most 16 requests in flight, the rest wait in arrival order; no time is
  lost between steps (optimistic for every order alike).

    python benchmarks/mixed_bound.py [--rate 2.5] [--peak 6.5] [--seeds 50]

It prints each order's peak in the model (to set against the 6.3 to 6.6
img/s measured), then, per order, the worst class's p50 over alone at the
given rate (that of the measured runs) and at half the peak: the median
over ``--seeds`` runs of 200 requests (the bench's size), and one run of
30,000. Last, the highest rate at which ``most_behind`` keeps every class
within 1.5x in the model.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np
from triton_omni.diffusion.steps import STARVE_AFTER  # shortest_first's bound, the engine's own

STEPS = (10, 20, 50)
SIZES = (384, 512)
CLOSED_LOOP = {1: 3.66, 2: 5.29, 4: 6.44, 8: 7.14, 16: 7.48}  # img/s, 512 px, 20 steps, direct (H200)
FIXED_S = {512: 0.032, 384: 0.023}  # a request's cost outside its steps
STEP_SOLO_S = {512: 0.0120, 384: 0.0098}  # one step alone, from the solo times
SIZE_RATIO = STEP_SOLO_S[384] / STEP_SOLO_S[512]  # 0.82
MAX_IN_FLIGHT = 16
ORDERS = ("round_robin", "shortest_first", "most_behind", "one_pass", "one_pass_2", "one_pass_4", "one_pass_8")
TARGET = 1.5


def step_cost_512(n: float) -> float:
    """A step of ``n`` requests at 512: the closed loop's time per image-step, less the fixed costs."""
    batches = sorted(CLOSED_LOOP)
    per_step = [b / (CLOSED_LOOP[b] * 20) - b * FIXED_S[512] / 20 for b in batches]
    return float(np.interp(n, batches, per_step))


def step_cost(size: int, n: float) -> float:
    return step_cost_512(n) * (1.0 if size == 512 else SIZE_RATIO)


def alone_s(steps: int, size: int) -> float:
    return steps * STEP_SOLO_S[size] + FIXED_S[size]


@dataclass
class Request:
    arrived: float
    steps: int
    size: int
    done: int = 0
    finished: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.steps} steps {self.size}px"


@dataclass
class Engine:
    order: str
    now: float = 0.0
    running: list[Request] = field(default_factory=list)
    passed: dict[int, int] = field(default_factory=dict)
    turn: itertools.count = field(default_factory=itertools.count)

    def step(self) -> list[Request]:
        """One step of the chosen group (or of everyone, ``one_pass``); the requests it finished."""
        groups = {size: [r for r in self.running if r.size == size] for size in SIZES}
        groups = {size: jobs for size, jobs in groups.items() if jobs}
        if self.order.startswith("one_pass"):
            cap = int(self.order.removeprefix("one_pass").lstrip("_") or MAX_IN_FLIGHT)
            jobs = sorted(self.running, key=lambda r: -self.behind(r))[:cap]
            n = sum(1.0 if r.size == 512 else SIZE_RATIO for r in jobs)
            self.now += step_cost_512(n)
        else:
            size = self.choose(groups)
            jobs = groups[size]
            self.now += step_cost(size, len(jobs))
        finished = []
        for r in jobs:
            r.done += 1
            if r.done == r.steps:
                self.now += FIXED_S[r.size]
                r.finished = self.now
                finished.append(r)
        self.running = [r for r in self.running if r.done < r.steps]
        return finished

    def behind(self, r: Request) -> float:
        """Its wait over its steps alone, as the engine's ``most_behind`` measures it."""
        return (self.now - r.arrived) / (r.steps * STEP_SOLO_S[r.size])

    def choose(self, groups: dict[int, list[Request]]) -> int:
        sizes = sorted(groups)
        if self.order == "round_robin":
            return sizes[next(self.turn) % len(sizes)]
        if self.order == "most_behind":
            return max(sizes, key=lambda size: max(map(self.behind, groups[size])))
        starved = [s for s in sizes if self.passed.get(s, 0) >= STARVE_AFTER]
        chosen = starved[0] if starved else min(
            sizes, key=lambda s: min((r.steps - r.done) * s * s for r in groups[s]))
        self.passed = {s: 0 if s == chosen else self.passed.get(s, 0) + 1 for s in sizes}
        return chosen


def simulate(order: str, rate: float, count: int, seed: int) -> dict[str, float]:
    """Each class's p50 over alone for ``count`` Poisson arrivals at ``rate``."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, count))
    classes = list(itertools.product(STEPS, SIZES))
    picks = rng.integers(0, len(classes), count)
    pending = [Request(float(t), *classes[k]) for t, k in zip(arrivals, picks, strict=True)]
    waiting: list[tuple[float, int, Request]] = []
    engine, done, i = Engine(order), [], 0
    while len(done) < count:
        while i < count and pending[i].arrived <= engine.now:  # arrivals up to now queue up
            heapq.heappush(waiting, (pending[i].arrived, i, pending[i]))
            i += 1
        while waiting and len(engine.running) < MAX_IN_FLIGHT:
            engine.running.append(heapq.heappop(waiting)[2])
        if not engine.running:  # idle until the next arrival
            engine.now = pending[i].arrived
            continue
        done += engine.step()
    by_class: dict[str, list[float]] = {}
    for r in done:
        by_class.setdefault(r.name, []).append((r.finished - r.arrived) / alone_s(r.steps, r.size))
    return {name: float(np.median(ratios)) for name, ratios in by_class.items()}


def peak(order: str) -> float:
    """Closed-loop throughput on the mix with 16 requests always in flight (the bench's peak)."""
    rng = np.random.default_rng(0)
    classes = list(itertools.product(STEPS, SIZES))
    engine, finished = Engine(order), 0
    engine.running = [Request(0.0, *classes[k]) for k in rng.integers(0, len(classes), MAX_IN_FLIGHT)]
    while finished < 5000:
        ended = engine.step()
        finished += len(ended)
        engine.running += [Request(engine.now, *classes[k]) for k in rng.integers(0, len(classes), len(ended))]
    return finished / engine.now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=2.5, help="arrivals/s of the H200 runs J and K (2.49, 2.51)")
    parser.add_argument("--peak", type=float, default=6.5, help="the mix's sustained peak measured in turns, img/s")
    parser.add_argument("--seeds", type=int, default=50)
    args = parser.parse_args()
    print("peak in the model (16 in flight), img/s: " + ", ".join(f"{o} {peak(o):.2f}" for o in ORDERS))
    print(f"measured peak, for 50 %: {args.peak:.2f} img/s\n")
    header = f"{'order':<16}{'rate/s':>7}{'load':>6}{'worst p50/alone: 200 req, median':>34}{'30k req':>9}  worst class"
    print(header + "\n" + "-" * len(header))
    for rate in (args.rate, args.peak / 2):
        for order in ORDERS:
            worst = [max(simulate(order, rate, 200, seed).values()) for seed in range(args.seeds)]
            long = simulate(order, rate, 30_000, seed=12345)
            name = max(long, key=long.get)
            print(f"{order:<16}{rate:>7.2f}{rate / args.peak:>6.0%}{np.median(worst):>34.2f}{long[name]:>9.2f}  {name}")
        print()
    rates = np.arange(1.5, args.peak / 2 + 0.01, 0.125)
    within = [rate for rate in rates if max(simulate("most_behind", rate, 30_000, seed=12345).values()) <= TARGET]
    print(f"most_behind keeps every class within {TARGET}x up to {max(within, default=0):.2f}/s "
          f"({max(within, default=0) / args.peak:.0%} of the peak) in the model")


if __name__ == "__main__":
    main()
