"""Step-level (continuous) batching of a pipeline's denoising loop (the
family's part of it, from noise to decode, is its step adapter, in its module
under ``triton_omni.families``).

Request-level batching runs a batch from its first step to its last; a
request that arrives meanwhile waits for all of it. Here the unit of work is
one denoising step: a request joins the running batch at the next step
boundary and leaves when its own steps are done, so at low load a request
starts at once and at high load the denoiser still sees full batches.

Each request keeps what makes its image its own: its latents (from its own
seeded generator), its own copy of the scheduler (so step counts may differ
within a batch), its classifier-free-guidance rows and scale, and its VAE
decode when its last step is done.

On a GPU the engine's thread never waits for the work it has just queued (a
wait drains the GPU while Python issues the next kernels), but keeps at most
``steps_ahead`` steps queued, so that a request that arrives joins the very
next step instead of one queued long before. Copies go through pinned
memory; a second thread waits for each batch of images. The engine's thread
runs every torch operation of its runner: on a CPU, two threads running
parallel torch work each get an OpenMP team, and the teams slow each other.

Requests that cannot share a forward pass (latent size, token count) form
groups, stepped one at a time in the ``group_order``: ``most_behind`` (the
default: the group holding the request furthest behind its time alone, as
"highest response ratio next" schedules, so the slowdown evens out across
classes), ``round_robin`` or ``shortest_first`` (least work left, as SRPT,
with a bound on starvation). A step's cost alone is measured per group
(``StepCosts``), not guessed from its pixels. Rows in flight are bounded
(``max_rows``); beyond it admission waits (FIFO) or rejects. A cancelled
request leaves at the next step.

Determinism: a row's output depends on the batch size only through kernel
choice (the low bits). ``exact=True`` pads every step to ``max_rows`` for
bit-identical images; otherwise a step runs its own rows, padded to
``buckets`` only where the denoiser wants few batch sizes (``fixed_shapes``:
one CUDA graph, or one compiled graph, each), and images agree within the
tolerance the tests state. Eagerly a padding row is pure waste: four requests
that arrive a few milliseconds apart start a step or two apart, and their
steps of three rows would each run four.
``per_request=True`` runs each request's forward passes on their own, at the
batch size its pipeline's own call uses: every image then equals that call's
bit for bit in any company (bf16 on a GPU included), and the forward passes
give up batching's gain (small for a large DiT image, whose passes are
already large matrix products); requests still join and leave at every step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from triton_omni.errors import RequestCancelledError, RequestRejectedError
from triton_omni.families import StepAdapter
from triton_omni.transfers import queued

logger = logging.getLogger(__name__)

# Rows a step is padded to. Past a few rows an SD UNet step on a GPU costs in
# proportion to its rows, so a padding row is pure waste: above 8 the buckets
# are 4 rows (two requests with guidance) apart, not a power of two.
BUCKETS = (1, 2, 4, 6, 8, *range(12, 65, 4))
GROUP_ORDERS = ("most_behind", "round_robin", "shortest_first")
# shortest_first: a group passed over this many steps in a row runs the next one (bounded waiting;
# a 10-step request of another size then costs a 50-step one at most one step in nine).
STARVE_AFTER = 8
# Steps queued on the GPU at most: one running and one ready to start when it ends (see above).
STEPS_AHEAD = 2


@dataclass(eq=False)
class StepJob:
    """One request in the engine: its inputs, and the state owned here."""

    # (cond, uncond, pooled), run at admission
    prepare: Callable[[], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
    rows: int  # denoiser rows per step: 2 with guidance (prompt and negative), else 1
    guidance_scale: float
    steps: int
    height: int
    width: int
    generator: torch.Generator
    on_step: Callable[[int, int], None] | None = None  # (step done, total)
    cancelled: Callable[[], bool] | None = None
    step_cache: Any = None  # its StepCacheConfig (step_cache.py) when it caches, else None
    on_cached: Callable[[int, int], None] | None = None  # (steps computed, steps skipped), when it ends
    images: list = field(default_factory=list)  # input images (the family's step adapter reads them)
    frames: int = 1  # a video's frame count (a video family's); 1 for an image
    lora: tuple[int, float] | None = None  # its LoRA adapter's (slot, scale) (lora.py), pinned while it runs
    guidance_scale_2: float | None = None  # the second denoiser's scale (Wan 2.2 A14B), where it has one
    future: Future = field(default_factory=Future)
    submitted: float = 0.0  # time.monotonic() when the engine got it (most_behind)
    # set when admitted
    cond: torch.Tensor | None = None  # [T, H]
    uncond: torch.Tensor | None = None  # [T, H] with guidance
    pooled: torch.Tensor | None = None  # [P] where the family reads a pooled embedding (FLUX.1)
    scheduler: Any = None
    timesteps: torch.Tensor | None = None  # on the device: the denoiser's input
    schedule: list[int] = field(default_factory=list)  # the same timesteps as ints: the scheduler's input
    latents: torch.Tensor | None = None
    step_kwargs: dict = field(default_factory=dict)
    done: int = 0
    key: tuple | None = None  # its group, as its family's step adapter says
    cache: dict | None = None  # its passes' step-cache state (step_cache.PassCache), set by its step adapter
    steps_skipped: int = 0  # steps whose passes all reused the cache

    def group(self) -> tuple:
        """What rows must share to run in one forward pass."""
        return self.key if self.key is not None else (self.height, self.width, self.cond.shape[0])

    def pixels(self) -> int:
        """Its output's pixels, every frame's: what a step costs grows with them."""
        return self.frames * self.height * self.width

    def work_left(self) -> int:
        """Its remaining steps times its pixels."""
        return (self.steps - self.done) * self.pixels()

    def behind(self, now: float, step_cost: float) -> float:
        """How far it is behind its time alone (up to a factor common to every request, if
        ``step_cost``, what one of its steps costs alone, is not in seconds)."""
        return (now - self.submitted) / (self.steps * step_cost)


class StepCosts:
    """What one step of a request alone costs in each group, learnt from the steps that ran one
    request and finished none (a last step also decodes): ``most_behind``'s measure of a request's
    time alone. On a GPU the step is timed by CUDA events around it, the GPU's own time, read
    once it has run without waiting for it; on a CPU, where each step runs as it is queued, by
    the clock."""

    SMOOTHING = 0.2  # weight of each new measurement (an exponential moving average)

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[tuple, float] = {}
        self._pending: deque[tuple[tuple, Any, Any]] = deque()  # (group, start event, end event) not yet run

    def start(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, group: tuple, started: Any) -> None:
        if not self.cuda:
            self._learn(group, time.perf_counter() - started)
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._pending.append((group, started, event))

    def update(self) -> None:
        """Learn from the timed steps the GPU has finished (never waits)."""
        while self._pending and self._pending[0][2].query():
            group, started, ended = self._pending.popleft()
            self._learn(group, started.elapsed_time(ended) / 1e3)

    def of(self, groups: dict[tuple, int]) -> dict[tuple, float]:
        """Each group's step cost: measured, or, until every one of ``groups`` has been, its
        pixels (``groups``' values: one unit for all, the ratios between groups are what orders them)."""
        if all(group in self.seconds for group in groups):
            return {group: self.seconds[group] for group in groups}
        return {group: float(pixels) for group, pixels in groups.items()}

    def _learn(self, group: tuple, seconds: float) -> None:
        old = self.seconds.get(group)
        self.seconds[group] = seconds if old is None else old + self.SMOOTHING * (seconds - old)


class StepEngine:
    def __init__(self, device: torch.device, dtype: torch.dtype, load: Callable[[torch.device], StepAdapter],
                 max_rows: int = 16, exact: bool = False, per_request: bool = False, on_full: str = "wait",
                 buckets: tuple[int, ...] = BUCKETS, on_batch: Callable[[int], None] | None = None,
                 group_order: str = "most_behind", steps_ahead: int = STEPS_AHEAD):
        """``load(device)``: run first on the engine's thread, which runs every torch operation of the
        engine's (the pipeline's load included): the family's step adapter, the engine's denoising
        loop; it returns once that is done, with its error if it failed. ``on_batch(n)``: after
        each step, the number of requests it ran (the batch-size metric); ``steps_ahead``: steps
        queued on the GPU at most (0: no bound; ignored off a GPU)."""
        if on_full not in ("wait", "reject"):
            raise ValueError(f"on_full must be 'wait' or 'reject', got {on_full!r}")
        if group_order not in GROUP_ORDERS:
            raise ValueError(f"group_order must be one of {', '.join(GROUP_ORDERS)}, got {group_order!r}")
        if not (isinstance(steps_ahead, int) and steps_ahead >= 0):
            raise ValueError(f"steps_ahead must be an integer of at least 0, got {steps_ahead!r}")
        self.group_order = group_order
        self._passed: dict[tuple, int] = {}  # group -> steps it was passed over in a row (shortest_first)
        if device.type == "cuda" and device.index is None:  # "cuda": the caller's current GPU, named
            device = torch.device("cuda", torch.cuda.current_device())  # (the engine's thread makes it current)
        self.device, self.dtype = device, dtype
        self.steps_ahead = steps_ahead if device.type == "cuda" else 0  # a CPU runs each step as it is issued
        self.costs = StepCosts(device) if group_order == "most_behind" else None
        self._queued: deque[Any] = deque()  # events: the steps still on the GPU (steps_ahead)
        self.max_rows, self.exact, self.per_request, self.on_full = max_rows, exact, per_request, on_full
        self.on_batch = on_batch
        self.buckets = (*(b for b in buckets if b < max_rows), max_rows)
        # whether steps are padded to the buckets: the runner clears it for a denoiser that runs
        # eagerly, once the family is loaded (its CUDA graphs and compile are decided then)
        self.fixed_shapes = True
        # whether each finished image is decoded on its own: the runner sets it once the family is
        # loaded (a compiled decoder then keeps one batch size; a VAE whose group norms are spread
        # decodes one image faster than its share of a batch)
        self.decode_alone = False
        self._waiting: deque[StepJob] = deque()
        self._running: dict[tuple, list[StepJob]] = {}
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._turn = itertools.count()
        self._held = 0  # rows of the jobs submitted and not yet done, waiting or running (under _wake)
        self._wake = threading.Condition()
        self._stopped = False
        # waits for each decoded batch's copy to the host, then resolves its futures (in order)
        self._delivery = ThreadPoolExecutor(1, thread_name_prefix="omni-diffusion-images")
        self.max_rows_seen = 0  # the most rows one step ran (tests, metrics)
        self._thread = threading.Thread(target=self._loop, name="omni-diffusion-steps", daemon=True)
        self._thread.start()
        try:
            self.adapter: StepAdapter = self.call(lambda: load(self.device)).result()
        except BaseException:
            self.stop()
            raise

    # -- the caller's side -----------------------------------------------------

    def submit(self, job: StepJob) -> Future:
        """The job's future resolves to its output on the CPU: an image ``[H, W, 3]`` uint8, or a
        video's frames ``[F, H, W, 3]``."""
        if job.rows > self.max_rows:
            raise RequestRejectedError(f"a request needs {job.rows} rows; this engine runs at most {self.max_rows}",
                                       "rows")
        with self._wake:
            if self.on_full == "reject" and self._held + job.rows > self.max_rows:
                raise RequestRejectedError(f"the diffusion engine is full ({self.max_rows} rows in flight)", "rows")
            self._held += job.rows
            job.submitted = time.monotonic()
            self._waiting.append(job)
            self._wake.notify()
        job.future.add_done_callback(lambda _: self._release(job.rows))
        return job.future

    def together(self) -> threading.Condition:
        """``with engine.together():`` the jobs submitted inside are admitted at the same step. Triton
        hands over the requests it batched in one ``execute``; without this, the engine could start
        the first while the others were still being submitted, and they would join a step later.
        Nothing inside may wait for the engine's thread."""
        return self._wake

    def has_room(self, rows: int = 2) -> bool:
        """Whether a request of ``rows`` submitted now would start at the next step
        rather than wait (two rows: a request with guidance)."""
        with self._wake:
            return self._held + rows <= self.max_rows

    def _release(self, rows: int) -> None:
        with self._wake:
            self._held -= rows

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine's thread between two steps (loading a pipeline, a warm-up)."""
        future: Future = Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=60)
        self._delivery.shutdown(wait=True)

    # -- the engine thread -----------------------------------------------------

    def _loop(self) -> None:
        if self.device.type == "cuda":  # this thread's kernels, streams and graphs go to the engine's GPU
            torch.cuda.set_device(self.device)
        while True:
            # Wait for the GPU here, before taking requests in and choosing the group, not once the
            # group is chosen: a request that arrives during the wait joins the step issued next.
            self._wait_for_room()
            with self._wake:
                while not self._stopped and not self._waiting and not self._running and not self._calls:
                    self._wake.wait()
                if self._stopped:
                    break
                calls, self._calls = self._calls, deque()
                admitted = self._admit()
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
            for job in admitted:
                self._start(job)
            group = self._next_group()
            if group is not None:
                self._step(group)
        for job in [*self._waiting, *(j for jobs in self._running.values() for j in jobs)]:
            job.future.set_exception(RequestCancelledError())

    def _admit(self) -> list[StepJob]:
        """Waiting jobs in arrival order, while their rows fit (called with the lock held)."""
        free = self.max_rows - (self._held - sum(job.rows for job in self._waiting))  # minus the running rows
        admitted = []
        while self._waiting and self._waiting[0].rows <= free:
            job = self._waiting.popleft()
            free -= job.rows
            admitted.append(job)
        return admitted

    def _start(self, job: StepJob) -> None:
        """The job's prompt encoded, its own scheduler, timesteps and initial noise; it joins its group."""
        try:
            job.cond, job.uncond, job.pooled = job.prepare()
            with torch.inference_mode():
                self.adapter.start(job)
            job.key = self.adapter.group(job)
        except Exception as exc:
            job.future.set_exception(exc)
            return
        self._running.setdefault(job.group(), []).append(job)

    def _next_group(self, now: float | None = None) -> list[StepJob] | None:
        """The group to step next, by ``group_order`` (``now``: the clock ``most_behind`` reads)."""
        keys = [key for key, jobs in self._running.items() if jobs]
        if not keys:
            return None
        if self.group_order == "round_robin":
            return self._running[keys[next(self._turn) % len(keys)]]
        if self.group_order == "most_behind":
            self.costs.update()
            now = time.monotonic() if now is None else now
            cost = self.costs.of({key: self._running[key][0].pixels() for key in keys})
            return self._running[max(keys, key=lambda k: max(job.behind(now, cost[k]) for job in self._running[k]))]
        starved = [key for key in keys if self._passed.get(key, 0) >= STARVE_AFTER]
        chosen = starved[0] if starved else min(keys, key=lambda k: min(job.work_left() for job in self._running[k]))
        self._passed = {key: 0 if key == chosen else self._passed.get(key, 0) + 1 for key in keys}
        return self._running[chosen]

    def _step(self, jobs: list[StepJob]) -> None:
        live = [job for job in jobs if not self._drop_if_cancelled(job)]
        jobs[:] = live
        if not live:
            return
        timed = self.costs is not None and len(live) == 1 and live[0].done + 1 < live[0].steps
        started = self.costs.start() if timed else None
        self._issue(jobs, live)
        if timed and not live[0].future.done():  # (a failed step is no measure)
            self.costs.stop(live[0].group(), started)
        if self.steps_ahead:
            issued = torch.cuda.Event(blocking=True)  # its waiter sleeps rather than spin on a core
            issued.record()
            self._queued.append(issued)

    def _wait_for_room(self) -> None:
        """With ``steps_ahead``, wait until fewer than that many steps are still on the GPU: a request
        submitted by the end of the wait joins the next step issued, and that step runs after every
        step queued before it."""
        while self.steps_ahead and len(self._queued) >= self.steps_ahead:
            self._queued.popleft().synchronize()

    def _issue(self, jobs: list[StepJob], live: list[StepJob]) -> None:
        """``live``'s step queued, its progress reported, its finished requests decoded."""
        try:
            self._advance(live)
        except Exception as exc:
            logger.exception("A denoising step of %d requests failed", len(live))
            for job in live:
                job.future.set_exception(exc)
            jobs.clear()
            return
        if self.on_batch is not None:
            self.on_batch(len(live))
        for job in live:
            if job.on_step is not None:
                job.on_step(job.done, job.steps)
        finished = [job for job in live if job.done == job.steps]
        for job in finished:
            jobs.remove(job)
            if job.on_cached is not None and job.cache is not None:
                job.on_cached(job.steps - job.steps_skipped, job.steps_skipped)
        self._finish(finished)
        self._running = {key: group for key, group in self._running.items() if group}

    def _advance(self, jobs: list[StepJob]) -> None:
        """One denoising step of every job: queued on the GPU, never waiting for it, so that
        the next step's kernels are issued while this one runs (tests/gpu checks it)."""
        with torch.inference_mode():
            if self.per_request:
                noise = [pred for job in jobs for pred in self.adapter.predict([job], self._rows_padded)]
            else:
                noise = self.adapter.predict(jobs, self._rows_padded)
            with queued(self.device):  # a scheduler's host copies and checks would wait for the step
                for job, pred in zip(jobs, noise, strict=True):
                    self.adapter.step(job, pred)
                    job.done += 1

    def _rows_padded(self, rows: int) -> int:
        """What a forward pass of ``rows`` real rows is padded to: ``max_rows`` with ``exact``, none
        with ``per_request`` (a request's own rows, as its pipeline runs them) or without
        ``fixed_shapes``, else its bucket."""
        self.max_rows_seen = max(self.max_rows_seen, rows)
        if self.per_request:
            return rows
        if self.exact:
            return self.max_rows
        return next(b for b in self.buckets if b >= rows) if self.fixed_shapes else rows

    def _drop_if_cancelled(self, job: StepJob) -> bool:
        if job.cancelled is not None and job.cancelled():
            job.future.set_exception(RequestCancelledError())
            return True
        return False

    def _finish(self, jobs: list[StepJob]) -> None:
        """Decode the finished jobs (all of one size: one group) as one VAE batch, or each
        alone with ``exact`` or ``per_request`` (a decode's low bits depend on its batch size) or
        ``decode_alone``; then pixels, delivered once they are on the host."""
        alone = self.exact or self.per_request or self.decode_alone
        for batch in ([[job] for job in jobs] if alone else [jobs] if jobs else []):
            try:
                with torch.inference_mode():
                    pixels, copied = pixels_to_host(self.adapter.decode(batch))
            except Exception as exc:
                logger.exception("Decoding %d images failed", len(batch))
                for job in batch:
                    job.future.set_exception(exc)
                continue
            if copied is None:
                _deliver(batch, pixels, None)
            else:
                self._delivery.submit(_deliver, batch, pixels, copied)


def _deliver(jobs: list[StepJob], pixels: torch.Tensor, copied: Any) -> None:
    """Each job's image, once the copy that fills ``pixels`` has landed (or the copy's
    error: run on the delivery thread, an exception left here would reach no one)."""
    try:
        if copied is not None:
            copied.synchronize()
    except Exception as exc:
        logger.exception("Copying %d images to the host failed", len(jobs))
        for job in jobs:
            job.future.set_exception(exc)
        return
    for job, image in zip(jobs, pixels, strict=True):
        job.future.set_result(image)


def pixels_to_host(images: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``[N, 3, H, W]`` in [0, 1] -> ``[N, H, W, 3]`` uint8 on the CPU (videos: ``[N, F, 3, H, W]``
    -> ``[N, F, H, W, 3]``), and the event that marks its copy done (``None``: nothing to wait for).
    From a GPU the copy is queued into pinned memory: the pixels are only valid once the event is."""
    pixels = _as_pixels(images)
    if pixels.device.type != "cuda":
        return pixels, None
    host = torch.empty(pixels.shape, dtype=pixels.dtype, pin_memory=True)
    host.copy_(pixels, non_blocking=True)
    copied = torch.cuda.Event(blocking=True)  # its waiter sleeps rather than spin on a core
    copied.record()
    return host, copied


def to_pixels(images: torch.Tensor) -> torch.Tensor:
    """``[N, 3, H, W]`` in [0, 1] -> ``[N, H, W, 3]`` uint8 on the CPU (videos: ``[N, F, 3, H, W]``
    -> ``[N, F, H, W, 3]``), in one copy (that waits)."""
    return _as_pixels(images).cpu()


def _as_pixels(images: torch.Tensor) -> torch.Tensor:
    """Channels last: the channel axis is the third from the end in images and videos alike."""
    return (images * 255).round().clamp(0, 255).to(torch.uint8).movedim(-3, -1).contiguous()
