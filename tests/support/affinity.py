"""What the kernel says a process's threads may run on, for the tests of
``engine_cpus``."""

from __future__ import annotations

from pathlib import Path


def thread_cpu_lists(pid: int) -> set[str]:
    """The distinct ``Cpus_allowed_list`` of process ``pid``'s threads."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split(":", 1)[1].strip())
    return lists
