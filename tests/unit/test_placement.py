"""Placement over GPUs, validated without a GPU: the specs, the configs they
write, the memory plan per GPU they imply, and where a stub instance runs."""

from __future__ import annotations

import os

import pytest
from triton_omni.triton.params import Placement, place_instance
from triton_omni_tools import memory_plan
from triton_omni_tools.cli import main
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, TritonServer
from triton_omni_tools.placement import PlacementError, StagePlacement, parse, parse_all, place_repositories
from triton_omni_tools.repository import load_config


@pytest.mark.parametrize(("spec", "expected"), [
    ("diffusion=0,1", StagePlacement("diffusion", (0, 1))),
    ("diffusion=1x2", StagePlacement("diffusion", (1,), per_gpu=2)),
    ("diffusion=all", StagePlacement("diffusion", (0, 1, 2, 3))),
    ("ar=tp:0,1", StagePlacement("ar", (0, 1), tensor_parallel=True)),
    ("ar_encoder=3", StagePlacement("ar_encoder", (3,))),
    ("ar=0x3:shared", StagePlacement("ar", (0,), per_gpu=3, shared=True)),
    ("diffusion=cfg:2,3", StagePlacement("diffusion", (2, 3), parallel="cfg")),
    ("diffusion=sp:0,1,2,3", StagePlacement("diffusion", (0, 1, 2, 3), parallel="sp")),
])
def test_specs(spec, expected):
    assert parse(spec, num_gpus=4) == expected
    assert str(expected) == spec.replace("all", "0,1,2,3")


@pytest.mark.parametrize(("spec", "message"), [
    ("diffusion", "expected STAGE=GPUS"),
    ("diffusion=0,0", "listed twice"),
    ("diffusion=2", "GPU 2 does not exist (GPUs on this machine: 2: 0..1)"),
    ("diffusion=0x0", "at least 1"),
    ("diffusion=tp:0,1", "'tp:' (one engine over several GPUs) is for the AR stages"),
    ("ar=tp:0,1x2", "takes no instance count"),
    ("diffusion=-1", "expected STAGE=GPUS"),
    ("diffusion=0x2:shared", "':shared' puts an AR stage's instances"),
    ("ar=0:shared", "needs at least two instances"),
    ("ar=tp:0,1:shared", "no 'tp:'"),
    ("ar=cfg:0,1", "'cfg:' (CFG parallel) is for diffusion"),
    ("diffusion=cfg:0", "over exactly two GPUs"),
    ("diffusion=cfg:0,1x2", "and one instance"),
    ("ar=sp:0,1", "'sp:' (sequence parallel) is for diffusion"),
    ("diffusion=sp:1", "over two GPUs or more"),
])
def test_bad_specs_are_refused_by_name(spec, message):
    with pytest.raises(PlacementError, match="placement") as info:
        parse(spec, num_gpus=2)
    assert message in str(info.value)


def test_cfg_parallel_is_one_model_instance_over_two_gpus():
    assert parse("diffusion=cfg:0,1", num_gpus=2).edits() == {
        "instance_group": [{"kind": "KIND_MODEL", "count": 1}], "parameters": {"gpus": "0,1", "parallel": "cfg"}}
    assert str(parse("diffusion=sp:1,0", num_gpus=2)) == "diffusion=sp:1,0"


def test_all_needs_a_gpu_and_each_stage_is_placed_once_and_served():
    with pytest.raises(PlacementError, match="none was found"):
        parse("diffusion=all", num_gpus=0)
    with pytest.raises(PlacementError, match="placed twice"):
        parse_all(["diffusion=0", "diffusion=1"], 2)
    with pytest.raises(PlacementError, match="no model 'difusion' is served"):
        parse_all(["difusion=0"], 2, {"diffusion", "ar"})


def test_placed_repositories_are_plain_triton_configs(tmp_path):
    repos = place_repositories(DEFAULT_REPOSITORIES, ["diffusion=0,1", "ar=tp:0,1", "ar_encoder=1x2"], 2, tmp_path)
    model_repo = next(r for r in repos if (r / "diffusion").exists())
    diffusion = load_config(model_repo / "diffusion" / "config.pbtxt")
    assert [(g.count, list(g.gpus)) for g in diffusion.instance_group] == [(1, [0, 1])]
    assert diffusion.parameters["model"].string_value == "demo:tiny-sd"  # the rest untouched
    ar = load_config(model_repo / "ar" / "config.pbtxt")
    assert len(ar.instance_group) == 1 and not ar.instance_group[0].gpus
    assert ar.parameters["gpus"].string_value == "0,1"
    encoder = load_config(model_repo / "ar_encoder" / "config.pbtxt")
    assert [(g.count, list(g.gpus)) for g in encoder.instance_group] == [(2, [1])]
    assert place_repositories(DEFAULT_REPOSITORIES, [], 2, tmp_path / "none") == list(DEFAULT_REPOSITORIES)


def test_the_memory_plan_follows_the_placement_per_gpu(tmp_path):
    repos = place_repositories(DEFAULT_REPOSITORIES, ["diffusion=0,1", "ar=tp:0,1"], 2, tmp_path / "a")
    by_gpu = {(s.model, s.gpu) for s in memory_plan.plan(repos, None, num_gpus=2)}
    assert by_gpu == {("ar", 0), ("ar", 1), ("ar_encoder", 0), ("diffusion", 0), ("diffusion", 1)}
    memory_plan.check(memory_plan.plan(repos, None, num_gpus=2))  # 0.7 on GPU 0, 0.6 on GPU 1

    crowded = place_repositories(DEFAULT_REPOSITORIES, ["diffusion=1x3", "ar=tp:0,1"], 2, tmp_path / "b")
    with pytest.raises(memory_plan.MemoryPlanError) as info:
        memory_plan.check(memory_plan.plan(crowded, None, num_gpus=2))
    assert "GPU 1: ar 0.3 + diffusion 0.3 x 3 = 1.20 > 0.95" in str(info.value)
    assert "GPU 0" not in str(info.value)


def test_instances_sharing_an_engine_take_one_share(tmp_path):
    """ar=0x3:shared is three stubs and one engine core: one share of GPU 0; ar=0x3 is three engines."""
    shared = place_repositories(DEFAULT_REPOSITORIES, ["ar=0x3:shared"], 1, tmp_path / "a")
    ar = load_config(next(r for r in shared if (r / "ar").exists()) / "ar" / "config.pbtxt")
    assert (ar.instance_group[0].count, ar.parameters["instances_per_engine"].string_value) == (3, "3")
    assert [(s.model, s.instances) for s in memory_plan.plan(shared, ["ar"], 1)] == [("ar", 1)]
    apart = place_repositories(DEFAULT_REPOSITORIES, ["ar=0x3"], 1, tmp_path / "b")
    assert [(s.model, s.instances) for s in memory_plan.plan(apart, ["ar"], 1)] == [("ar", 3)]


def test_a_placement_needs_the_gpus_it_names(monkeypatch, capsys):
    monkeypatch.setattr("triton_omni_tools.launcher.gpu_count", lambda: 0)
    with pytest.raises(PlacementError, match="GPU 1 does not exist"):
        TritonServer(ServerOptions(placement=["diffusion=0,1"]))
    assert main(["serve", "--place", "diffusion=0,1"]) == 2
    assert "error: placement 'diffusion=0,1': GPU 1 does not exist (GPUs on this machine: none)" \
        in capsys.readouterr().err


def test_serve_takes_every_familys_demo_and_names_them_for_a_wrong_one(capsys):
    from triton_omni.families import DEMOS
    from triton_omni_tools.demos import demo_edits

    for demo in DEMOS:  # what docs/models.md says `serve --demo` takes
        edits = demo_edits(demo)
        assert demo == "sd" or edits["diffusion"]["parameters"]["model"] == f"demo:{DEMOS[demo].model}"
    assert {"flux2-klein", "flux2-dev", "flux1-dev", "qwen-image-edit"} <= set(DEMOS)
    assert main(["serve", "--demo", "flux3"]) == 2
    error = capsys.readouterr().err
    assert "error: --demo must be one of sd, qwen-image" in error and "flux1-dev" in error and "'flux3'" in error


# -- where one stub instance runs ------------------------------------------------------


def test_instances_run_where_triton_puts_them(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert place_instance({"model_instance_kind": "CPU"}, {}) == Placement("cpu")
    assert place_instance({"model_instance_kind": "CPU"}, {}).label == "cpu"
    gpu1 = place_instance({"model_instance_kind": "GPU", "model_instance_device_id": 1}, {})
    assert gpu1 == Placement("cuda:1", (1,)) and gpu1.label == "gpu1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # Triton's device 1 is then physical GPU 3
    assert place_instance({"model_instance_kind": "GPU", "model_instance_device_id": 1}, {}).gpus == (3,)


def test_an_engine_over_several_gpus_sees_only_those(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    placement = place_instance({"model_instance_kind": "MODEL"}, {"gpus": "2,0"}, spans_gpus=True)
    assert placement == Placement("cuda", (6, 4)) and placement.label == "gpu6+gpu4"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,4"  # what vLLM's engine and workers will see


def test_a_torch_runner_takes_one_gpu_and_bad_gpus_are_refused(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert place_instance({"model_instance_kind": "MODEL"}, {"gpus": "1"}) == Placement("cuda:1", (1,))
    with pytest.raises(ValueError, match="runs on one"):
        place_instance({"model_instance_kind": "MODEL"}, {"gpus": "0,1"})
    for bad in ("a", "0,0", "-1", "1,"):
        with pytest.raises(ValueError, match="model parameter 'gpus' must list distinct GPU indexes"):
            place_instance({"model_instance_kind": "MODEL"}, {"gpus": bad})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(Exception, match="GPU 1 is not among the 1 visible"):
        place_instance({"model_instance_kind": "MODEL"}, {"gpus": "1"})


def test_a_video_demo_gets_a_gateway_of_one_process():
    """/v1/videos jobs live in one gateway process's memory (several answer them 501): `serve --demo
    wan` starts one; an image demo keeps the default."""
    from triton_omni_tools.cli import _gateway_workers

    assert _gateway_workers("wan", 4) == 1
    assert _gateway_workers("flux1-dev", 4) == 4 and _gateway_workers("sd", 3) == 3
