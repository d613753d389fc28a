"""``DaemonPool``, the BLS calls' thread pool: it runs work as ``ThreadPoolExecutor`` does, and a
thread blocked for good in a call (a stream whose responses stopped coming) does not keep the
process from exiting, as it kept the ``omni`` stub alive past its server's shutdown."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from triton_omni.aio import DaemonPool


def test_it_runs_work_and_hands_back_results_and_errors():
    pool = DaemonPool(4, "test-pool")
    try:
        assert [f.result(5) for f in [pool.submit(pow, 2, n) for n in range(10)]] == [2**n for n in range(10)]
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(5)
        assert asyncio.run(_in_executor(pool)) == 42
        assert len(pool._threads) <= 4
    finally:
        pool.shutdown()


async def _in_executor(pool: DaemonPool) -> int:
    return await asyncio.get_running_loop().run_in_executor(pool, lambda: 42)


def test_it_starts_a_thread_only_when_none_is_idle():
    pool = DaemonPool(8, "test-pool")
    try:
        for _ in range(5):  # one after another: the first thread serves them all
            pool.submit(time.sleep, 0).result(5)
        assert len(pool._threads) == 1
        release = threading.Event()
        held = [pool.submit(release.wait, 5) for _ in range(3)]
        pool.submit(time.sleep, 0).result(5)  # the first is busy: more threads start
        assert len(pool._threads) >= 4
        release.set()
        assert all(f.result(5) for f in held)
    finally:
        pool.shutdown()


def test_shutdown_cancels_queued_work_and_refuses_more():
    pool = DaemonPool(1, "test-pool")
    release = threading.Event()
    running = pool.submit(release.wait, 5)
    queued = pool.submit(time.sleep, 0)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    release.set()
    assert running.result(5)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(time.sleep, 0)


def test_a_thread_blocked_for_good_does_not_keep_the_process_alive():
    """The same program with ``ThreadPoolExecutor`` never exits (its threads are joined at exit)."""
    program = textwrap.dedent("""
        import threading
        from triton_omni.aio import DaemonPool
        pool = DaemonPool(2, "blocked")
        pool.submit(threading.Event().wait)  # never returns
        pool.shutdown(wait=False)
        print("exiting", flush=True)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "exiting\n", done.stderr
    assert time.monotonic() - started < 30
    with pytest.raises(subprocess.TimeoutExpired):  # the comparison: the standard pool's thread holds it open
        subprocess.run([sys.executable, "-c", program.replace("from triton_omni.aio import DaemonPool",
                                                              "from concurrent.futures import ThreadPoolExecutor")
                        .replace('DaemonPool(2, "blocked")', "ThreadPoolExecutor(2)")], capture_output=True, timeout=5)
