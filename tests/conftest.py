"""What the whole suite shares: nothing it makes in /dev/shm, nor the project's folders in the
temporary folder, outlives the suite's servers and the processes that made it.

Checked once, after every other session-scoped fixture has stopped its servers (this one is set up
first, so it is torn down last): a leftover fails the run as an error in the last test's teardown,
naming the files. What the pytest process itself still maps (its own multiprocessing objects, alive
until it exits) is not a leftover."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from triton_omni_tools.reaper import SHM, mapped_shared_memory

PROJECT_TEMP_PREFIX = "triton-omni-"  # run folders, engine seats, the gateway's metrics folder


def made_here() -> set[Path]:
    """Every /dev/shm entry, and the project's own entries in the temporary folder."""
    return {*SHM.iterdir(), *Path(tempfile.gettempdir()).glob(PROJECT_TEMP_PREFIX + "*")}


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind():
    before = made_here()
    yield
    left = made_here() - before - mapped_shared_memory([os.getpid()])
    assert not left, f"the suite left these behind: {sorted(map(str, left))}"
