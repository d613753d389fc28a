"""One thread per model instance talks to the server about responses.

``InferenceResponseSender.send`` and ``is_cancelled`` are IPC calls to the
server and may block. Made from the engine's event loop they stall every
other request. Made from several threads at once, alongside BLS traffic,
they deadlocked a Triton 2.51 stub here: the event loop sat in
``is_cancelled`` while another stub waited in ``send``. So the engine loop
only enqueues, and this thread sends every response (the Triton vLLM
backend's design). Between sends, it polls the cancellation of the
requests it is asked to watch: a share of its time at most (``POLL_SHARE``),
round-robin, since every poll is an IPC round trip too and 64 streams polled
every 50 ms would leave little time for their responses.

Streamed responses coalesce (``send_streamed``): while a request's last
response still waits in the queue, the next one merges into it. Each send
is an IPC round trip, so one thread sends a bounded number per second; under
load (many streams, a token every few milliseconds each) a stream then gets
fewer, larger responses instead of a growing backlog, as vLLM's own DELTA
outputs do for a slow reader. At low load nothing waits and every token is
its own response.

Two lanes: a stream's first response and every request's final one go
first (``urgent``), the responses in between wait in the other lane. Under
load each send waits for the GIL (the engine loop computes meanwhile), and
the thread sends a response of each stream in turn, a long round at high
concurrency: the first token and the final response waited that round in one
queue, lengthening time to first token and, for a closed-loop client,
the gap before its next request, which left the engine fewer requests to
batch. The middle of a stream only merges more. A response never overtakes
one queued before it for the same request: those move to the urgent lane
ahead of it. Function calls (metric updates) take the urgent lane too, so
that a request is counted before its final response leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils

from triton_omni.channel import StageErrors
from triton_omni.errors import RequestCancelledError
from triton_omni.triton.errors import error_response

logger = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_STREAMED = -1  # a coalescing entry of send_streamed
_CALL = -2  # a function to run on this thread (call)
# how often the thread asks the server about cancellations (TRITON_OMNI_CANCEL_POLL_S overrides it)
POLL_S = float(os.environ.get("TRITON_OMNI_CANCEL_POLL_S", "0.05"))
POLL_SHARE = 0.2  # of each poll interval, at most, spent asking the server about cancellations


@dataclass
class _Queued:
    sender: object  # a response sender; for _CALL the function
    payload: object  # the response; for _STREAMED the coalescing entry [item, final, build]
    flags: int


class ResponseThread:
    def __init__(self, poll_s: float = POLL_S):
        self._urgent: deque[_Queued] = deque()
        self._later: deque[_Queued] = deque()
        self._stopping = False
        self._watched: dict[int, tuple[object, Callable[[], None], Callable[[], bool] | None]] = {}
        self._unsent: dict[int, list] = {}  # sender id -> [item, final, build], queued but not yet sent
        # sender id -> the omni key of a request the scheduler sent (BLS), and whether it has had a
        # response: such a request's error after its first response goes through StageErrors
        self._bls: dict[int, list] = {}
        self._stage_errors: StageErrors | None = None
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._poll_s = poll_s
        self._poll_from = 0  # where the next round of cancellation polls starts
        self._thread = threading.Thread(target=self._drain, name="omni-responses", daemon=True)
        self._thread.start()

    def send(self, sender, response=None, final: bool = False) -> None:
        """Queue a response; a final one takes the urgent lane."""
        with self._lock:
            self._put(_Queued(sender, response, FINAL if final else 0), urgent=final)

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this thread, before any response queued after it:
        how the other IPC to the server (metric updates) leaves the stub too."""
        with self._lock:
            self._urgent.append(_Queued(fn, None, _CALL))
            self._ready.notify()

    def send_streamed(self, sender, item, final: bool, merge: Callable, build: Callable,
                      urgent: bool = False) -> None:
        """Queue ``build(item)`` for ``sender``, or merge ``item`` into the one
        still waiting for it (``merge(waiting, item)``); tensors are built
        once, on this thread, just before the send. ``urgent`` (a stream's
        first response) or ``final``: the urgent lane."""
        urgent = urgent or final
        with self._lock:
            waiting = self._unsent.get(id(sender))
            if waiting is not None:
                waiting[0] = merge(waiting[0], item)
                waiting[1] = waiting[1] or final
                if urgent:
                    self._promote(sender)
                return
            self._unsent[id(sender)] = entry = [item, final, build]
            self._put(_Queued(sender, entry, _STREAMED), urgent)

    def _put(self, queued: _Queued, urgent: bool) -> None:
        """Under the lock: queue in a lane, and wake the thread."""
        if urgent:
            self._promote(queued.sender)
            self._urgent.append(queued)
        else:
            self._later.append(queued)
        self._ready.notify()

    def _promote(self, sender) -> None:
        """Under the lock: what waits in the later lane for ``sender`` moves to
        the urgent one, in order, so that nothing overtakes it."""
        moved = [queued for queued in self._later if queued.sender is sender]
        if moved:
            self._urgent.extend(moved)
            self._later = deque(queued for queued in self._later if queued.sender is not sender)

    @contextlib.asynccontextmanager
    async def serving(self, sender, context: str, metrics, started: float,
                      cancelled_elsewhere: Callable[[], bool] | None = None,
                      on_cancel: Callable[[], Awaitable[None]] | None = None,
                      key: str | None = None) -> AsyncIterator[None]:
        """One decoupled request's life, for the coroutine that serves it.

        The request counts as in flight; a cancellation (the client's, or
        ``cancelled_elsewhere()``) cancels the serving task at once, wherever
        it waits; ``on_cancel`` then stops the engine's work. Every path ends
        with exactly one final response: the body's own on success, CANCELLED,
        or the error of whatever the body raised. ``key``: the omni key of a
        request the scheduler sent, whose error after its first response is
        recorded for it (``StageErrors``), the stream ending with a final flag
        alone: BLS would lose that error response and its final flag."""
        metrics.in_flight.increment(1)
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        if key is not None:
            with self._lock:
                self._bls[id(sender)] = [key, False]
        self.watch(sender, lambda: loop.call_soon_threadsafe(task.cancel), cancelled_elsewhere)
        try:
            yield
            metrics.finished("success", started)
        except asyncio.CancelledError:
            if on_cancel is not None:
                await on_cancel()
            self.fail(sender, RequestCancelledError(), context, metrics, started)
        except Exception as exc:
            self.fail(sender, exc, context, metrics, started)
        finally:
            self.unwatch(sender)
            metrics.in_flight.increment(-1)

    def fail(self, sender, exc: BaseException, context: str, metrics, started: float | None = None) -> None:
        """End a request with the error response for ``exc`` (counted in ``metrics``)."""
        self.send(sender, error_response(exc, context, metrics, started), final=True)

    def watch(self, sender, on_cancel: Callable[[], None],
              cancelled_elsewhere: Callable[[], bool] | None = None) -> None:
        """Call ``on_cancel`` (once, on this thread) when the client cancels the
        request, or when ``cancelled_elsewhere()`` says so (the ``omni``
        scheduler's cancel flag for a request it sent)."""
        with self._lock:
            self._watched[id(sender)] = (sender, on_cancel, cancelled_elsewhere)

    def unwatch(self, sender) -> None:
        with self._lock:
            self._watched.pop(id(sender), None)

    def _drain(self) -> None:
        next_poll = time.monotonic() + self._poll_s
        while True:
            with self._ready:
                if not (self._urgent or self._later or self._stopping):
                    self._ready.wait(max(0.0, next_poll - time.monotonic()))
                lane = self._urgent or self._later
                queued = lane.popleft() if lane else None
                if queued is None and self._stopping:
                    return
            if queued is not None:
                self._send(queued.sender, queued.payload, queued.flags)
            if time.monotonic() >= next_poll:
                self._poll_cancellations()
                next_poll = time.monotonic() + self._poll_s

    def _send(self, sender, response, flags) -> None:
        if flags == _CALL:
            try:
                sender()
            except Exception:
                logger.exception("A call on the response thread failed")
            return
        if flags == _STREAMED:
            with self._lock:
                item, final, build = self._unsent.pop(id(sender))
            try:
                response, flags = build(item), FINAL if final else 0
            except Exception as exc:  # a response that cannot be built ends the request with its error
                logger.exception("Could not build a response")
                response, flags = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), FINAL
        if flags & FINAL:
            # Never poll a request after its final response: the server frees its
            # response factory, and is_cancelled() on it crashes tritonserver (seen).
            # Only this thread polls, so dropping the watch here closes the race.
            self.unwatch(sender)
        response = self._through_bls(sender, response, flags)
        if response is None and not flags & FINAL:
            return
        # The sender drops the outputs the request did not ask for (an ensemble step's unmapped
        # ones: ar_encoder's prompt_embeds_mask in text_to_image) after releasing the GIL, and
        # a tensor whose last owner that was frees its Python buffer without it: tritonserver
        # 2.51's stub crashed so (SIGSEGV in ~PbTensor, under PruneOutputTensors). Holding the
        # tensors here makes this thread, with the GIL, their last owner.
        held = response.output_tensors() if isinstance(response, pb_utils.InferenceResponse) else None
        try:
            sender.send(response, flags=flags)
        except Exception:
            logger.exception("Could not send a response (flags=%s)", flags)
        del held

    def _through_bls(self, sender, response, flags: int):
        """``response``, or None (the final flag alone) where it is an error after the first
        response of a request the scheduler sent: its message recorded for the scheduler
        instead (Triton 2.51's BLS delivers no error response but a stream's first)."""
        with self._lock:
            bls = self._bls.get(id(sender))
            if bls is not None and flags & FINAL:
                del self._bls[id(sender)]
        if bls is None:
            return response
        key, answered = bls
        bls[1] = True
        if not (answered and response is not None and response.has_error()):
            return response
        if self._stage_errors is None:
            self._stage_errors = StageErrors()
        try:
            self._stage_errors.record(key, response.error().message())
        except OSError:
            logger.exception("Could not record a stage error for the scheduler")
        if not flags & FINAL:
            logger.warning("an error response that does not end its stream, to the scheduler: dropped")
        return None

    def _poll_cancellations(self) -> None:
        """Poll the watched requests in turn, for at most ``POLL_SHARE`` of a
        poll interval; the next round goes on where this one stopped."""
        with self._lock:
            watched = list(self._watched.items())
        if not watched:
            return
        start = self._poll_from % len(watched)
        deadline = time.monotonic() + self._poll_s * POLL_SHARE
        polled = 0
        for key, (sender, on_cancel, cancelled_elsewhere) in watched[start:] + watched[:start]:
            if polled and time.monotonic() >= deadline:
                break
            polled += 1
            try:
                if not (sender.is_cancelled() or (cancelled_elsewhere is not None and cancelled_elsewhere())):
                    continue
            except Exception:
                logger.exception("Could not check a request's cancellation")
                continue
            with self._lock:
                self._watched.pop(key, None)
            on_cancel()
        self._poll_from = start + polled

    def stop(self) -> None:
        """Send what is queued, then end the thread."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        self._thread.join(timeout=30)
