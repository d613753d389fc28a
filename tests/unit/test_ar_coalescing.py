"""``batch_wait_ms``'s scheduler: a few fresh prompts do not get a step of
their own behind a running one; an idle engine and a full batch never wait;
nothing waiting is lost. vLLM's own ``schedule`` is stood in for here (it
schedules every waiting prompt); tests/integration/test_ar_encoder_batch_wait.py
runs the scheduler in a real engine."""

import time
from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm")

from triton_omni.ar.coalescing import CoalescingScheduler
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue


@dataclass
class Prompt:
    arrival_time: float


@dataclass
class Output:
    num_scheduled_tokens: dict = field(default_factory=dict)


@pytest.fixture
def scheduler(monkeypatch):
    seen = []

    def schedule(self, *args, **kwargs):
        seen.append(len(self.waiting))
        output = Output({i: 10 for i in range(len(self.waiting))})
        self.waiting = FCFSRequestQueue()
        return output

    monkeypatch.setattr(AsyncScheduler, "schedule", schedule)
    monkeypatch.setattr("triton_omni.ar.coalescing.create_request_queue", lambda policy: FCFSRequestQueue())
    sched = CoalescingScheduler.__new__(CoalescingScheduler)  # no engine: the policy alone
    sched.batch_wait_s, sched.max_num_running_reqs, sched.policy = 0.05, 8, "fcfs"
    sched.running, sched.waiting = [], FCFSRequestQueue()
    sched.seen = seen
    return sched


def arrive(sched, n: int, ago: float = 0.0) -> None:
    for _ in range(n):
        sched.waiting.append(Prompt(time.time() - ago))


def test_an_idle_engine_starts_at_once(scheduler):
    arrive(scheduler, 1)
    assert len(scheduler.schedule().num_scheduled_tokens) == 1
    assert scheduler.seen == [1]


def test_fresh_prompts_wait_for_the_step_after_the_running_one(scheduler):
    scheduler.running = ["a step of three"] * 3
    arrive(scheduler, 2)
    assert scheduler.schedule().num_scheduled_tokens == {}  # not a step of their own behind it
    assert len(scheduler.waiting) == 2  # set aside for that call only
    scheduler.running = []  # the step is done
    arrive(scheduler, 3)
    assert len(scheduler.schedule().num_scheduled_tokens) == 5  # one step for all
    assert scheduler.seen == [0, 5]


def test_no_wait_for_a_full_batch_an_old_prompt_or_when_off(scheduler):
    scheduler.running = ["running"] * 2
    arrive(scheduler, 6)  # with the running ones: max_num_running_reqs
    assert len(scheduler.schedule().num_scheduled_tokens) == 6
    arrive(scheduler, 1, ago=0.1)  # has waited longer than batch_wait_s
    assert len(scheduler.schedule().num_scheduled_tokens) == 1
    scheduler.batch_wait_s = 0.0
    arrive(scheduler, 1)
    assert scheduler._should_wait() is False
