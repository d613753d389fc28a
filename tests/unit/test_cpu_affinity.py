"""``engine_cpus`` (``triton_omni.cpu_affinity``): the CPU list parsed and
checked against the CPUs this process may use, with errors that name the
value; and a real process tree (threads, a child, a grandchild) pinned. vLLM's
engine core pinned for real: tests/integration/test_engine_cpus.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from triton_omni.ar import ArRunnerConfig
from triton_omni.cpu_affinity import descendants, format_cpus, parse_cpus, pin_process_tree

from tests.support import fake_pb_utils
from tests.support.affinity import thread_cpu_lists

fake_pb_utils.install()

from triton_omni.triton.ar_io import runner_config  # noqa: E402 - after the fake pb_utils

AVAILABLE = sorted(os.sched_getaffinity(0))


def test_cpu_lists_parse_as_taskset_writes_them():
    first = AVAILABLE[0]
    assert parse_cpus(str(first)) == {first}
    assert parse_cpus(format_cpus(AVAILABLE)) == set(AVAILABLE)
    assert format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize(("text", "message"), [
    ("seven", "engine_cpus 'seven' is not a CPU list such as '7'"),
    ("2-", "is not a CPU list"),
    ("3-1", "is not a CPU list"),
    ("", "is not a CPU list"),
    ("4096", f"engine_cpus '4096': CPUs 4096 are not on this host; it has CPUs {format_cpus(range(os.cpu_count()))}"),
])
def test_a_bad_cpu_list_is_refused_naming_the_value(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_cpus(text)


TREE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_every_thread_of_a_process_and_of_its_children_is_pinned():
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.2)  # the thread is up
        assert set(descendants(parent.pid)) == {parent.pid, child}
        pinned = frozenset(AVAILABLE[-1:])
        assert sorted(pin_process_tree(parent.pid, pinned)) == sorted([parent.pid, child])
        assert len(list(Path(f"/proc/{parent.pid}/task").glob("*"))) >= 2
        assert thread_cpu_lists(parent.pid) == thread_cpu_lists(child) == {format_cpus(pinned)}
    finally:
        for pid in descendants(parent.pid)[::-1]:
            os.kill(pid, 9)
        parent.wait()


def test_the_model_parameter_reaches_the_runner_and_only_vllm_takes_it():
    config = {"name": "ar", "parameters": {"engine": {"string_value": "vllm"},
                                           "engine_cpus": {"string_value": "6-7"}}}
    assert runner_config(config, {"model_instance_kind": "KIND_CPU"})[0].engine_cpus == "6-7"
    from triton_omni.ar import ArRunner

    with pytest.raises(ValueError, match="engine_cpus '0' pins vLLM's engine core process; the transformers"):
        ArRunner(ArRunnerConfig("demo:tiny-qwen2", engine="transformers", engine_cpus="0"))
