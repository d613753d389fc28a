"""An asyncio event loop on its own thread (one per model instance).

Triton calls ``execute`` on its own threads; engines are asyncio-native. The
loop thread lets ``execute`` hand work over with ``submit`` and return at once
(decoupled models) or wait for a ``Future`` (batched models), the way Triton's
vLLM backend does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
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
