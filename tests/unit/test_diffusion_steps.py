"""Step batching of the diffusion runner, on the tiny demo pipeline (CPU, no server).

Tolerance: a request's image run in company differs from the same request
run alone by at most 1/255 per pixel channel (the UNet ran at another batch
size: other kernels, other low bits); with ``exact_batching`` it is
identical.
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
import torch
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.errors import RequestCancelledError, RequestRejectedError

TOLERANCE = 1  # per uint8 channel


def runner(**config) -> DiffusionRunner:
    return DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", batching="step", **config))


@pytest.fixture(scope="module")
def steps():
    r = runner(batch_size=4)
    yield r
    r.close()


@pytest.fixture(scope="module")
def reference():
    """Request batching, unpadded: each request alone is the reference image."""
    return DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", exact_batching=False))


def request(r: DiffusionRunner, seed: int, steps: int = 6, size: int = 32, guidance: float = 5.0,
            prompt: str = "a red fox"):
    return r.parse({"prompt": prompt, "seed": seed, "num_inference_steps": steps, "guidance_scale": guidance,
                    "height": size, "width": size})


MIXED = [dict(seed=1), dict(seed=2, steps=3, guidance=1.0), dict(seed=3, steps=8, prompt="a lighthouse at dusk"),
         dict(seed=4, size=64), dict(seed=5, guidance=9.0, prompt="x")]


def assert_close(a: torch.Tensor, b: torch.Tensor, message: str = "") -> None:
    difference = (a.int() - b.int()).abs().max().item()
    assert difference <= TOLERANCE, f"{message}: max pixel difference {difference}"


def test_together_equals_alone_for_mixed_requests(steps, reference):
    """Different steps counts, guidance on and off, sizes (separate groups) and prompts, all at once."""
    alone = [reference.run([request(reference, **m)])[0] for m in MIXED]
    together = steps.run([request(steps, **m) for m in MIXED])
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert a.shape == b.shape
        assert_close(a, b, f"request {i}")
    assert steps.steps.max_rows_seen >= 5  # the 32x32 requests shared steps (rows: 2 + 1 + 2 + 2)
    assert not torch.equal(together[0], together[4])


def test_a_request_joins_mid_flight_and_leaves_when_done(steps, reference):
    first_steps, submitted = threading.Event(), threading.Event()
    seen_rows, long_done = [], []

    def on_step(done: int, total: int) -> None:
        seen_rows.append(steps.steps.max_rows_seen)
        long_done.append(done)
        if done == 2:
            first_steps.set()
            submitted.wait(60)  # the engine's thread holds here until the short one is in, however late this runs

    long = steps.submit(request(steps, 10, steps=12), on_step=on_step)
    assert first_steps.wait(60)
    short = steps.submit(request(steps, 11, steps=3))  # joins at the next step, leaves after 3
    at_short_end: list[int] = []
    short.add_done_callback(lambda _: at_short_end.append(long_done[-1]))
    submitted.set()
    assert_close(short.result(60), reference.run([request(reference, 11, steps=3)])[0], "joined")
    assert at_short_end[0] < 12, "the short request finished first: it joined the running batch"
    assert_close(long.result(60), reference.run([request(reference, 10, steps=12)])[0], "running")


def test_a_request_that_arrives_while_the_engine_waits_joins_the_next_step():
    """On a GPU the engine waits for room (``steps_ahead``) between steps; a request submitted
    meanwhile runs in the step issued after the wait, not the one after that. The wait is
    stood in for by a hook in the same place (a CPU engine does not wait)."""
    r = runner()
    ran: list[tuple[str, int]] = []
    arrived: list = []
    armed = threading.Event()

    def wait_for_room() -> None:  # the engine's own thread, between two steps
        if armed.is_set() and not arrived:
            arrived.append(r.submit(request(r, 13, steps=2), on_step=lambda done, _: ran.append(("short", done))))

    def on_long(done: int, total: int) -> None:
        ran.append(("long", done))
        if done == 2:
            armed.set()

    r.steps._wait_for_room = wait_for_room
    try:
        long = r.submit(request(r, 12, steps=6), on_step=on_long)
        long.result(60), arrived[0].result(60)
    finally:
        r.close()
    joined = ran.index(("short", 1))
    assert ran[joined - 1] == ("long", 3), ran  # the short request's first step ran with the long one's third


def test_cancel_drops_one_request_at_the_next_step(steps, reference):
    cancel = threading.Event()
    progress = []

    def on_step(done: int, total: int) -> None:
        progress.append(done)
        if done == 2:
            cancel.set()

    futures = [steps.submit(request(steps, 20 + i, steps=8), on_step=on_step if i == 1 else None,
                            is_cancelled=cancel.is_set if i == 1 else None) for i in range(3)]
    with pytest.raises(RequestCancelledError):
        futures[1].result(60)
    assert max(progress) <= 3  # one step may be in flight when the flag is set
    for i in (0, 2):
        assert_close(futures[i].result(60), reference.run([request(reference, 20 + i, steps=8)])[0], f"request {i}")


def test_rows_in_flight_are_bounded_and_admission_waits(reference):
    small = runner(max_rows=2)  # one guided request at a time
    try:
        images = small.run([request(small, 30 + i, steps=3) for i in range(3)])
        assert small.steps.max_rows_seen == 2
        for i, image in enumerate(images):
            assert_close(image, reference.run([request(reference, 30 + i, steps=3)])[0], f"request {i}")
    finally:
        small.close()


def test_a_full_engine_rejects_when_configured():
    strict = runner(max_rows=2, on_full="reject")
    try:
        first = strict.submit(request(strict, 40, steps=6))
        with pytest.raises(RequestRejectedError):
            strict.submit(request(strict, 41, steps=6))
        first.result(60)
    finally:
        strict.close()


def test_has_room_says_whether_a_request_would_start_or_wait():
    small = runner(max_rows=4)  # two guided requests
    try:
        assert small.steps.has_room()
        first = small.submit(request(small, 50, steps=6))
        assert small.steps.has_room() and not small.steps.has_room(rows=3)
        second = small.submit(request(small, 51, steps=6))
        assert not small.steps.has_room(rows=1)
        first.result(60), second.result(60)
    finally:
        small.close()


def test_exact_batching_is_bit_identical_alone_and_in_company():
    exact = runner(batch_size=2, exact_batching=True)  # every step padded to 4 rows
    try:
        alone = [exact.run([request(exact, 50 + i, steps=4)])[0] for i in range(3)]
        together = exact.run([request(exact, 50 + i, steps=4) for i in range(3)])
        for a, b in zip(alone, together, strict=True):
            assert torch.equal(a, b)
    finally:
        exact.close()


def test_requests_submitted_together_start_at_the_same_step():
    """Triton's batch, handed over in one ``execute``, starts as one: the engine, stepping another
    request meanwhile, waits at its next admission until the last of them is in."""
    requests_per_step: list[int] = []
    r = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", batching="step"), on_batch=requests_per_step.append)
    stepping = threading.Event()
    try:
        long = r.submit(request(r, 20, steps=40, guidance=1.0), on_step=lambda done, _: stepping.set())
        assert stepping.wait(60)
        with r.steps.together():
            joined = []
            for seed in (21, 22, 23):
                joined.append(r.submit(request(r, seed, steps=2, guidance=1.0)))
                time.sleep(0.1)  # several of the long request's steps, were the engine not waiting
        [future.result(60) for future in joined]
        assert not long.done()
        long.result(60)
    finally:
        r.close()
    assert requests_per_step.count(4) == 2 and {2, 3}.isdisjoint(requests_per_step), requests_per_step


def test_an_eager_step_runs_its_own_rows_and_a_fixed_shape_one_its_bucket():
    """Padding rows buy nothing without a CUDA graph or a compiled graph per bucket: eagerly a step
    of 3 requests runs 3 rows, not 4 (test_compile holds that a compiled denoiser keeps buckets)."""
    r = runner(batch_size=4, exact_batching=False)
    engine = r.steps
    padded = engine._rows_padded
    seen = []
    engine._rows_padded = lambda rows: seen.append((rows, padded(rows))) or seen[-1][1]
    try:
        assert not engine.fixed_shapes  # a CPU: no graphs, nothing compiled
        r.run([request(r, 60 + i, steps=2, guidance=1.0) for i in range(3)])  # one row each
        assert (3, 3) in seen
        engine.fixed_shapes = True
        assert [padded(rows) for rows in (1, 3, 4, 5, 7)] == [1, 4, 4, 6, 8]
    finally:
        r.close()


def test_scheduler_state_stays_per_request(reference):
    """A multistep solver keeps a history of model outputs: shared between
    requests, each would step with the others' history and change its image."""
    from diffusers import DPMSolverMultistepScheduler

    multistep = runner()
    try:
        for r in (multistep, reference):
            r.pipeline.scheduler = DPMSolverMultistepScheduler.from_config(r.pipeline.scheduler.config)
        try:
            alone = [reference.run([request(reference, 60 + i, steps=5 + i)])[0] for i in range(3)]
        finally:
            from diffusers import DDIMScheduler

            reference.pipeline.scheduler = DDIMScheduler.from_config(reference.pipeline.scheduler.config)
        together = multistep.run([request(multistep, 60 + i, steps=5 + i) for i in range(3)])
        for i, (a, b) in enumerate(zip(alone, together, strict=True)):
            assert_close(a, b, f"request {i}")
        assert len({np.asarray(t).tobytes() for t in together}) == 3
    finally:
        multistep.close()


def _steps_in_order(order: str, long: dict, short: dict) -> list[str]:
    """Which request each step ran ("long"/"short"), the short one submitted once the long one
    (another size: another group) has done 2 steps; both images checked against them alone."""
    r = runner(group_order=order)
    ran: list[str] = []
    started, submitted = threading.Event(), threading.Event()

    def on_long(done: int, total: int) -> None:
        ran.append("long")
        if done == 2:
            started.set()
            submitted.wait(60)  # the engine's thread holds until the short one is in, however late this runs

    try:
        first = r.submit(request(r, 70, **long), on_step=on_long)
        assert started.wait(60)
        second = r.submit(request(r, 71, **short), on_step=lambda done, total: ran.append("short"))
        submitted.set()
        images = first.result(120), second.result(120)
    finally:
        r.close()
    reference = DiffusionRunner(DiffusionRunnerConfig("demo:tiny-sd", exact_batching=False))
    for image, (seed, m) in zip(images, ((70, long), (71, short)), strict=True):
        assert_close(image, reference.run([request(reference, seed, **m)])[0], f"seed {seed}")
    return ran


def test_shortest_first_lets_a_short_request_of_another_size_pass_a_long_one():
    ran = _steps_in_order("shortest_first", dict(size=64, steps=16), dict(size=32, steps=4))
    short_steps = [i for i, who in enumerate(ran) if who == "short"]
    # once it is in, the short request runs its 4 steps back to back (one long step may be in flight)
    assert short_steps[-1] - short_steps[0] == 3, ran
    assert ran.count("long") == 16 and ran[-1] == "long"


def test_round_robin_gives_the_two_sizes_a_step_each_in_turn():
    ran = _steps_in_order("round_robin", dict(size=64, steps=16), dict(size=32, steps=4))
    short_steps = [i for i, who in enumerate(ran) if who == "short"]
    assert [b - a for a, b in itertools.pairwise(short_steps)] == [2, 2, 2], ran


def test_shortest_first_still_steps_a_group_passed_over():
    """The long group has more work left than the other all along, and still gets a step
    after ``STARVE_AFTER`` of the other's."""
    from triton_omni.diffusion.steps import STARVE_AFTER

    ran = _steps_in_order("shortest_first", dict(size=64, steps=12, guidance=1.0), dict(size=32, steps=30))
    first_short = ran.index("short")
    last_short = len(ran) - 1 - ran[::-1].index("short")
    runs, current = [], 0
    for who in ran[first_short:last_short + 1]:
        if who == "short":
            current += 1
        else:
            runs.append(current)
            current = 0
    assert runs and max([*runs, current]) <= STARVE_AFTER, ran


def test_most_behind_lets_a_short_request_of_another_size_pass_a_long_one():
    ran = _steps_in_order("most_behind", dict(size=64, steps=16), dict(size=32, steps=4))
    short_steps = [i for i, who in enumerate(ran) if who == "short"]
    assert short_steps[-1] - short_steps[0] == 3, ran
    assert ran.count("long") == 16 and ran[-1] == "long"


def _job(steps: int, size: int, waited_s: float, now: float):
    from triton_omni.diffusion.steps import StepJob

    return StepJob(prepare=lambda: None, rows=2, guidance_scale=5.0, steps=steps, height=size, width=size,
                   generator=torch.Generator(), submitted=now - waited_s)


@pytest.mark.parametrize(("short_waited_s", "measured", "first"),
                         [(0.01, False, "long"), (0.1, False, "short"), (0.1, True, "long"), (0.3, True, "short")])
def test_most_behind_steps_the_group_furthest_behind_its_time_alone(short_waited_s, measured, first):
    """A 50-step request that has waited 1 s against a 10-step one of another size. Unmeasured, a
    step costs its latent area (64x64 against 32x32): the long one is behind by 1 / (50 x 4096),
    the short one by its wait / (10 x 1024), so 10 ms puts it less behind (new short arrivals do
    not starve the long one) and 100 ms more. Measured at 10 ms a step in both groups, the long one
    is behind by 1 / 0.5 and the short one by its wait / 0.1: it passes after 200 ms."""
    import time

    from triton_omni.diffusion.steps import StepEngine

    engine = StepEngine(torch.device("cpu"), torch.float32, lambda device: None, group_order="most_behind")
    try:
        now = time.monotonic()
        groups = {"long": (64, 64, 77), "short": (32, 32, 77)}  # (height, width, prompt tokens)
        engine._running = {groups["long"]: [_job(50, 64, 1.0, now)],
                           groups["short"]: [_job(10, 32, short_waited_s, now)]}
        if measured:
            engine.costs.seconds = {group: 0.01 for group in groups.values()}
        # at the jobs' own clock: a stall between the two reads once flipped the close cases
        assert engine._next_group(now) is engine._running[groups[first]]
    finally:
        engine.stop()


def test_most_behind_learns_what_a_step_costs_alone():
    """Steps that ran one request and finished none are timed, per group (size, tokens)."""
    r = runner(group_order="most_behind")
    try:
        r.run([request(r, 80, steps=4, size=32)])
        r.run([request(r, 81, steps=4, size=64)])
        costs = r.steps.costs.seconds
    finally:
        r.close()
    assert sorted(group[:2] for group in costs) == [(32, 32), (64, 64)], costs
    assert all(0 < seconds < 10 for seconds in costs.values()), costs


def test_an_unknown_group_order_is_refused():
    with pytest.raises(ValueError, match="group_order"):
        runner(group_order="fastest")


def test_steps_ahead_below_zero_is_refused():
    with pytest.raises(ValueError, match="steps_ahead"):
        runner(steps_ahead=-1)


def test_steps_ahead_is_ignored_off_a_gpu(steps):
    """A CPU runs each step as it is queued: nothing to bound, and no CUDA events."""
    assert steps.config.steps_ahead == 2 and steps.steps.steps_ahead == 0
