"""CPUs of its own for vLLM's engine core (model parameter ``engine_cpus``).

vLLM's engine core is one Python thread that schedules, prepares and
launches every step, and for a small model on a fast GPU that thread, not
the GPU, sets the pace: its steps are as fast as the CPU it happens to run
on, and what else runs beside it matters. Pinning the engine core, with
every thread and process under it, to chosen CPUs keeps it where the
operator put it; keeping the rest of the server off them is the operator's
part (docs/operations.md). On a virtual machine whose CPUs share cores,
pinning cannot choose a quiet core.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

from triton_omni.processes import parents

logger = logging.getLogger(__name__)


def parse_cpus(text: str, parameter: str = "engine_cpus") -> frozenset[int]:
    """``"7"``, ``"6,7"``, ``"4-7,12"`` (the list ``taskset -c`` takes) as a
    set of this host's CPUs; else a ``ValueError`` naming the parameter, the
    value and the CPUs there are. (Not only those this process may use: a
    bench keeps itself off the CPUs it gives its engines.)"""
    available = set(range(os.cpu_count() or 1))
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None or int(match[2] or match[1]) < int(match[1]):
            raise ValueError(f"{parameter} {text!r} is not a CPU list such as '7', '6,7' or '4-7,12'")
        cpus.update(range(int(match[1]), int(match[2] or match[1]) + 1))
    if missing := cpus - available:
        raise ValueError(f"{parameter} {text!r}: CPUs {format_cpus(missing)} are not on this host; "
                         f"it has CPUs {format_cpus(available)}")
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """The shortest CPU list: ``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (``/proc``'s parent links)."""
    children: dict[int, list[int]] = {}
    for child, parent in parents().items():
        children.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        process = todo.pop()
        tree.append(process)
        todo += children.get(process, [])
    return tree


def pin_process_tree(pid: int, cpus: frozenset[int]) -> list[int]:
    """Every thread of ``pid`` and of the processes under it runs on ``cpus``
    from now on (threads they start later inherit it). Returns the processes.

    A thread an unpinned thread starts while the tree is walked would keep the
    old CPUs (a fresh-clone run saw one): the walk repeats until it finds no
    thread it has not pinned yet."""
    pinned: set[int] = set()  # thread ids (unique across processes)
    while True:
        tree = descendants(pid)
        tasks = {int(task.name) for process in tree for task in Path(f"/proc/{process}/task").glob("*")}
        if tasks <= pinned:
            break
        for task in tasks - pinned:
            try:
                os.sched_setaffinity(task, cpus)
            except (ProcessLookupError, FileNotFoundError):  # a thread that just ended
                continue
            except OSError as error:  # EINVAL: none of them in this container's cpuset
                raise ValueError(f"engine_cpus {format_cpus(cpus)}: the kernel refused them ({error.strerror}); "
                                 f"this process may run on CPUs {format_cpus(os.sched_getaffinity(0))}") from None
        pinned |= tasks
    logger.info("processes %s pinned to CPUs %s", tree, format_cpus(cpus))
    return tree
