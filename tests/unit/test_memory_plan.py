"""The GPU memory plan: the launcher's check over all models, and the load-time
check of one model's share (nvidia-smi faked on PATH; no GPU needed)."""

from __future__ import annotations

import os
import stat

import pytest
from triton_omni.gpu_memory import MemoryPlanError as LoadError
from triton_omni.gpu_memory import check_share, physical_index
from triton_omni_tools import memory_plan
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES


def write_model(repo, name: str, share: str, instance_group: str = "instance_group [{ kind: KIND_MODEL }]"):
    (repo / name).mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'backend: "python"\n{instance_group}\n'
        f'parameters {{ key: "gpu_memory_utilization" value {{ string_value: "{share}" }} }}\n')


def test_the_default_repository_fits_one_gpu():
    shares = memory_plan.plan(DEFAULT_REPOSITORIES, None, num_gpus=1)
    assert {s.model for s in shares} == {"ar", "ar_encoder", "diffusion"}
    memory_plan.check(shares)  # no error
    assert "GPU 0 memory plan" in memory_plan.describe(shares)


def test_a_plan_over_the_gpu_names_the_models_and_numbers(tmp_path):
    write_model(tmp_path, "ar", "0.6")
    write_model(tmp_path, "diffusion", "0.25", "instance_group [{ kind: KIND_GPU count: 2 gpus: [0] }]")
    write_model(tmp_path, "other", "0.9", "instance_group [{ kind: KIND_CPU }]")  # not on a GPU
    shares = memory_plan.plan([tmp_path], None, num_gpus=1)
    with pytest.raises(memory_plan.MemoryPlanError) as info:
        memory_plan.check(shares)
    message = str(info.value)
    assert "GPU 0: ar 0.6 + diffusion 0.25 x 2 = 1.10 > 0.95" in message
    assert "other" not in message


def test_kind_gpu_without_gpus_counts_on_every_gpu_and_only_loaded_models_count(tmp_path):
    write_model(tmp_path, "diffusion", "0.5", "instance_group [{ kind: KIND_GPU count: 1 }]")
    write_model(tmp_path, "ar", "0.6")
    shares = memory_plan.plan([tmp_path], ["diffusion"], num_gpus=2)
    assert [(s.model, s.gpu) for s in shares] == [("diffusion", 0), ("diffusion", 1)]
    memory_plan.check(shares)


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """An nvidia-smi reporting a 100 GiB GPU with 30 GiB free."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho '102400, 30720'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_a_share_that_is_not_free_fails_the_load_with_the_numbers(fake_gpu):
    check_share("diffusion", 0.25, (0,))  # 25 GiB of 30 free: fits
    with pytest.raises(LoadError) as info:
        check_share("ar", 0.4, (0,))
    message = str(info.value)
    assert "model 'ar'" in message and "gpu_memory_utilization 0.4" in message
    assert "40.0 GiB of its 100.0 GiB" in message and "only 30.0 GiB is free" in message


def test_shares_are_checked_for_range_and_ignored_on_cpu():
    check_share("ar", 0.3, ())
    with pytest.raises(LoadError, match="must be in"):
        check_share("ar", 1.5, ())


def test_cuda_visible_devices_maps_to_the_physical_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert physical_index("cuda:1") == 1 and physical_index("cuda") == 3


@pytest.mark.parametrize("loaded", [["diffusion", "diffusion_request"],
                                    ["diffusion", "diffusion_request", "diffusion_shortest_first"],
                                    ["diffusion", "diffusion_request", "diffusion_shortest_first",
                                     "diffusion_round_robin"]])
def test_the_open_loop_bench_fits_one_gpu_with_the_modes_it_loads(tmp_path, loaded):
    """`bench --open-loop` loads a copy of diffusion per mode it measures (four by default) on one
    GPU; each gets an equal part of the plan, never more than diffusion's own share."""
    from triton_omni_tools.bench import PRESETS, openloop

    repositories = openloop.repository(PRESETS["realistic"], tmp_path, len(loaded))
    shares = memory_plan.plan(repositories, loaded, num_gpus=1)
    assert sorted(s.model for s in shares) == sorted(loaded)
    memory_plan.check(shares)  # no error
    assert all(s.share == min(0.3, openloop.COPIES_SHARE / len(loaded)) for s in shares)
