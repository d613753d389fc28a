"""Where the CPU goes during a timed window (Linux ``/proc``): the whole
host, vLLM's engine core processes, the tritonserver process itself.

Why: through Triton, vLLM's engine steps can run slower than direct at the
same concurrency, with the same engine code on the same GPU. An engine core is a Python busy loop that
needs a core of its own; these figures show what else runs beside it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from triton_omni.processes import command_line, parents, stat_fields

TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` has used (all its threads; 0 when it is gone)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICK if fields else 0.0


def host_busy_s() -> float:
    """CPU seconds the whole host has been busy since boot (every core; not idle, not waiting on I/O)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / TICK  # user..steal, less idle and iowait


def engine_cores(root: int, children_only: bool = False) -> list[int]:
    """vLLM's engine core processes (vLLM titles them VLLM::EngineCore) among
    ``root``'s descendants, or its children only: the bench's own engines,
    not those of the server it started."""
    parent_of = parents()
    found = []
    for pid, parent in parent_of.items():
        while not children_only and parent not in (root, None) and parent > 1:
            parent = parent_of.get(parent)
        if parent == root and command_line(pid).startswith(b"VLLM::EngineCore"):
            found.append(pid)
    return found


class CpuWindow:
    """CPU use between ``start()`` and ``stop()``, in cores (CPU seconds per
    second): ``host``, ``engine`` (the processes ``engines``) and, given
    ``server``, ``tritonserver``."""

    def __init__(self, engines: list[int], server: int | None = None):
        self.engines, self.server = engines, server

    def _sample(self) -> dict[str, float]:
        sample = {"host": host_busy_s(), "engine": sum(process_cpu_s(pid) for pid in self.engines)}
        if self.server is not None:
            sample["tritonserver"] = process_cpu_s(self.server)
        return sample

    def start(self) -> CpuWindow:
        self._before, self._t0 = self._sample(), time.monotonic()
        return self

    def stop(self) -> dict[str, float]:
        after, seconds = self._sample(), time.monotonic() - self._t0
        return {key: (after[key] - self._before[key]) / seconds for key in after}
