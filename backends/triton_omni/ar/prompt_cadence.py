"""New prompts join a busy vLLM engine every N steps, not at every step.

A step that holds a new prompt costs several decode steps on vLLM's default
CUDA graphs (the attention runs outside the graph when prompt and decode
tokens share a step: 6 to 10 ms against 2 to 3 ms on an H200, at 32 to 64
streams). Clients that finish and resubmit together put all their prompts
in one such step; clients whose requests arrive a few milliseconds apart,
as they do through any server, put them in many, and the whole batch pays
for each. vLLM 0.24 already has the remedy, for data-parallel engines only:
``prefill_schedule_interval`` admits new prompts on every N-th step, and its
scheduler defers them on the other steps while requests are decoding (an
idle engine admits at once; a queue too long for one step is never held
back). Its single engine core ignores the setting. ``with_prompt_cadence``
makes it count there too, through the scheduler class vLLM lets a config
name: this one asks vLLM's own scheduler to defer prompts off the beat.

The price is time to first token: a prompt that arrives while the engine is
busy waits up to N - 1 steps.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

ENGINE_ARG = "prefill_schedule_interval"  # vLLM's own name for N


class _PromptCadence:
    def schedule(self, throttle_prefills: bool = False):
        interval = self.scheduler_config.prefill_schedule_interval
        # schedule() counts the step it plans first: this is step current_step + 1
        off_beat = interval > 1 and (self.current_step + 1) % interval != 0
        return super().schedule(throttle_prefills or off_beat)


class CadencedScheduler(_PromptCadence, Scheduler):
    """vLLM's scheduler with prompts admitted on the beat (synchronous scheduling)."""


class CadencedAsyncScheduler(_PromptCadence, AsyncScheduler):
    """vLLM's asynchronous scheduler with prompts admitted on the beat."""


def with_prompt_cadence(config: Any) -> Any:
    """``config`` (a ``VllmConfig``) with the cadenced scheduler where its
    ``prefill_schedule_interval`` is above 1 and vLLM would ignore it: one
    engine (a data-parallel engine does it itself), one that generates, and
    no scheduler class of the user's own."""
    scheduler = config.scheduler_config
    if (scheduler.prefill_schedule_interval > 1 and scheduler.scheduler_cls is None
            and config.parallel_config.data_parallel_size == 1
            and config.model_config.runner_type == "generate"):
        chosen = CadencedAsyncScheduler if scheduler.async_scheduling else CadencedScheduler
        scheduler.scheduler_cls = f"{chosen.__module__}.{chosen.__qualname__}"
    return config
