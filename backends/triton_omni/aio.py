"""An asyncio event loop on its own thread (one per model instance).

Triton calls ``execute`` on its own threads; engines are asyncio-native. The
loop thread lets ``execute`` hand work over with ``submit`` and return at once
(decoupled models) or wait for a ``Future`` (batched models), the way Triton's
vLLM backend does.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopThread:
    def __init__(self, name: str = "omni-engine-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run to completion from another thread; exceptions propagate."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loop.close()


class DaemonPool(Executor):
    """A thread pool whose threads do not keep the process alive. ``ThreadPoolExecutor`` joins its
    threads when the interpreter exits, so one thread blocked for good (a BLS stream whose
    responses stopped coming: a stage's stub died, or the stream was cancelled and Triton
    delivers no more of it) keeps a stub from ever exiting, and its server's shutdown waits out
    Triton's exit timeout. Threads start as work needs them, up to ``max_workers``."""

    def __init__(self, max_workers: int, name: str):
        self._max, self._name = max_workers, name
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # a permit per thread waiting for work
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args, **kwargs) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                thread = threading.Thread(target=self._serve, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                self._idle.release()
                continue
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as exc:  # the caller's to see
                result, error = None, exc
            self._idle.release()  # idle before the caller hears: its next submit finds this thread
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._work.put(None)
        if wait:
            for thread in self._threads:
                thread.join()
