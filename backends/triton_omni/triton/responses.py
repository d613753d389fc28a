"""Sends decoupled responses from one thread, in order.

``InferenceResponseSender.send`` talks to the server over IPC and may block;
doing it on the engine's event loop would stall every other request. The
engine loop enqueues, this thread sends (the Triton vLLM backend's design).
"""

from __future__ import annotations

import logging
import queue
import threading

import triton_python_backend_utils as pb_utils

logger = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class ResponseThread:
    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name="omni-responses", daemon=True)
        self._thread.start()

    def send(self, sender, response=None, final: bool = False) -> None:
        self._queue.put((sender, response, FINAL if final else 0))

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            sender, response, flags = item
            try:
                sender.send(response, flags=flags)
            except Exception:
                logger.exception("Could not send a response (flags=%s)", flags)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
