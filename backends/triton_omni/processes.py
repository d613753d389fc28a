"""Whether a process is alive, read from ``/proc`` (Linux), for the files that
a model's instances share: load records, seats in front of a shared engine."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int | None) -> bool:
    """Running: not gone, and not a zombie (a killed stub stays one until the server reaps it)."""
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
