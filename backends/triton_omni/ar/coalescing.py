"""A vLLM scheduler that does not start a small step behind a running one
(``ar_encoder``'s ``batch_wait_ms``; off by default, experimental).

Why: an encoder step has a large fixed cost beside its cost per prompt. On an
H200, for the realistic preset's prompts, a rough fit gives 2.2 ms of
engine-core time per step and 0.36 ms per prompt (docs/benchmarks.md,
"Eleventh pass").
- Callers of vLLM in one process get a step's outputs at once and send their
  next prompts at once.
- Through Triton those prompts come back spread over several milliseconds,
  because the stub's threads share one GIL.
- vLLM's asynchronous scheduling then queues a step for the first few while
  the current step runs. It ran steps of 4 to 6 prompts where direct callers
  gave it 15, and each step paid the fixed cost.

What: while a step runs, prompts that arrived less than ``batch_wait_s`` ago
are not scheduled behind it, unless a full batch waits. They join the step
after it, with everything else that arrives meanwhile. An idle engine starts
at once, so a lone caller never waits.

It is vLLM's ``AsyncScheduler`` with that check in front. A subclass of the
plain ``Scheduler`` turns vLLM's asynchronous scheduling off. vLLM's V1 engine
has no such setting (V0's ``delay_factor`` delayed prefills while decodes
ran). ``engine_args`` names the class as the engine's ``scheduler_cls``, which
the engine core process imports, and passes the wait in vLLM's
``additional_config``.
"""

from __future__ import annotations

import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import create_request_queue

BATCH_WAIT_KEY = "triton_omni_batch_wait_ms"  # in vLLM's additional_config, milliseconds



class CoalescingScheduler(AsyncScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.additional_config
        wait_ms = extra.get(BATCH_WAIT_KEY, 0.0) if isinstance(extra, dict) else 0.0
        self.batch_wait_s = float(wait_ms) / 1000

    def schedule(self, *args, **kwargs):
        if self._should_wait():
            return self._schedule_without_waiting(*args, **kwargs)
        return super().schedule(*args, **kwargs)

    def _should_wait(self) -> bool:
        """A step runs, and the prompts waiting for the next one are few and fresh."""
        if self.batch_wait_s <= 0 or not self.running:
            return False
        waiting = len(self.waiting)
        if waiting == 0 or waiting + len(self.running) >= self.max_num_running_reqs:
            return False
        oldest = min(request.arrival_time for request in self.waiting)
        return time.time() - oldest < self.batch_wait_s  # arrival_time: the frontend's time.time()

    def _schedule_without_waiting(self, *args, **kwargs):
        """vLLM's own schedule (its bookkeeping, the running requests) with the waiting prompts set aside."""
        queues = [name for name in ("waiting", "skipped_waiting") if hasattr(self, name)]
        kept = {name: getattr(self, name) for name in queues}
        for name in queues:
            setattr(self, name, create_request_queue(self.policy))
        try:
            return super().schedule(*args, **kwargs)
        finally:
            for name, queue in kept.items():
                setattr(self, name, queue)


def engine_args(batch_wait_ms: float) -> dict:
    """The vLLM engine arguments that make an encoder engine wait ``batch_wait_ms``; none for 0."""
    if batch_wait_ms <= 0:
        return {}
    return {"scheduler_cls": f"{CoalescingScheduler.__module__}.{CoalescingScheduler.__qualname__}",
            "additional_config": {BATCH_WAIT_KEY: batch_wait_ms}}
