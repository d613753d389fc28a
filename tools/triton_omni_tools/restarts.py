"""When ``omni-triton serve`` starts tritonserver again after it died.

Triton 2.51 can abort on its own (a ``boost::interprocess::lock_exception``
when a stub is killed at the wrong moment); the launcher is then the process
that brings it back, as a container runtime would restart a container. A
server that keeps dying is not restarted for ever: at most ``max_restarts``
within ``window_s``, each after a longer pause, and then the launcher exits
with the server's status so that whatever runs it (Kubernetes, systemd) sees
the failure.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 600.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _recent: deque[float] = field(default_factory=deque, repr=False)

    def next_delay(self) -> float | None:
        """The pause before the next restart, counted as one; ``None`` once
        ``max_restarts`` restarts already happened within the window."""
        now = self.clock()
        while self._recent and now - self._recent[0] > self.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            return None
        delay = min(self.max_delay_s, self.first_delay_s * 2 ** len(self._recent))
        self._recent.append(now)
        return delay

    @property
    def recent(self) -> int:
        """Restarts within the window, as of the last ``next_delay``."""
        return len(self._recent)


def died_abnormally(returncode: int | None) -> bool:
    """Killed by a signal (an abort included) or exited with an error, unasked."""
    return returncode is not None and returncode != 0


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"
