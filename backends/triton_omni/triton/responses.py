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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import triton_python_backend_utils as pb_utils

from triton_omni.errors import RequestCancelledError
from triton_omni.triton.errors import error_response

logger = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_STREAMED = -1  # queue marker: a coalescing entry of send_streamed
_CALL = -2  # queue marker: a function to run on this thread (call)
# how often the thread asks the server about cancellations (TRITON_OMNI_CANCEL_POLL_S overrides it)
POLL_S = float(os.environ.get("TRITON_OMNI_CANCEL_POLL_S", "0.05"))
POLL_SHARE = 0.2  # of each poll interval, at most, spent asking the server about cancellations


class ResponseThread:
    def __init__(self, poll_s: float = POLL_S):
        self._queue: queue.Queue = queue.Queue()
        self._watched: dict[int, tuple[object, Callable[[], None], Callable[[], bool] | None]] = {}
        self._unsent: dict[int, list] = {}  # sender id -> [item, final, build], queued but not yet sent
        self._lock = threading.Lock()
        self._poll_s = poll_s
        self._poll_from = 0  # where the next round of cancellation polls starts
        self._thread = threading.Thread(target=self._drain, name="omni-responses", daemon=True)
        self._thread.start()

    def send(self, sender, response=None, final: bool = False) -> None:
        self._queue.put((sender, response, FINAL if final else 0))

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this thread, in order with the responses: how the
        other IPC to the server (metric updates) leaves the stub too."""
        self._queue.put((fn, None, _CALL))

    def send_streamed(self, sender, item, final: bool, merge: Callable, build: Callable) -> None:
        """Queue ``build(item)`` for ``sender``, or merge ``item`` into the one
        still waiting for it (``merge(waiting, item)``); tensors are built
        once, on this thread, just before the send."""
        with self._lock:
            waiting = self._unsent.get(id(sender))
            if waiting is not None:
                waiting[0] = merge(waiting[0], item)
                waiting[1] = waiting[1] or final
                return
            self._unsent[id(sender)] = entry = [item, final, build]
        self._queue.put((sender, entry, _STREAMED))

    @contextlib.asynccontextmanager
    async def serving(self, sender, context: str, metrics, started: float,
                      cancelled_elsewhere: Callable[[], bool] | None = None,
                      on_cancel: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[None]:
        """One decoupled request's life, for the coroutine that serves it.

        The request counts as in flight; a cancellation (the client's, or
        ``cancelled_elsewhere()``) cancels the serving task at once, wherever
        it waits; ``on_cancel`` then stops the engine's work. Every path ends
        with exactly one final response: the body's own on success, CANCELLED,
        or the error of whatever the body raised."""
        metrics.in_flight.increment(1)
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
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
            try:
                item = self._queue.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                self._send(*item)
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
        self._queue.put(None)
        self._thread.join(timeout=30)
