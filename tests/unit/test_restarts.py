"""The launcher's restart policy: growing pauses, and a budget per window."""

from __future__ import annotations

import signal

from triton_omni_tools.restarts import RestartPolicy, describe_exit, died_abnormally


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pauses_double_up_to_the_cap_and_the_budget_ends_restarts():
    clock = Clock()
    policy = RestartPolicy(max_restarts=5, window_s=600, first_delay_s=1, max_delay_s=4, clock=clock)
    assert [policy.next_delay() for _ in range(6)] == [1, 2, 4, 4, 4, None]


def test_restarts_older_than_the_window_no_longer_count():
    clock = Clock()
    policy = RestartPolicy(max_restarts=2, window_s=600, clock=clock)
    assert policy.next_delay() == 1 and policy.next_delay() == 2
    assert policy.next_delay() is None
    clock.now = 601
    assert policy.next_delay() == 1
    assert policy.recent == 1


def test_what_counts_as_dying_and_how_it_is_told():
    assert died_abnormally(-signal.SIGABRT) and died_abnormally(1)
    assert not died_abnormally(0) and not died_abnormally(None)
    assert describe_exit(-signal.SIGABRT) == "killed by SIGABRT"
    assert describe_exit(3) == "exited with status 3"
