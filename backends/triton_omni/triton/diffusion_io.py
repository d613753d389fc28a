"""The diffusion stage's Triton contract: tensor tables, config completion, runner config."""

from __future__ import annotations

from triton_omni_protocol import diffusion_inputs, diffusion_outputs

from triton_omni.diffusion import DiffusionRunnerConfig
from triton_omni.diffusion.steps import STEPS_AHEAD
from triton_omni.gpu_memory import parse_gpus
from triton_omni.triton.params import (
    Placement,
    gpu_share,
    json_parameter,
    lora_settings,
    model_parameters,
    place_instance,
)
from triton_omni.triton.tensors import complete_config


def auto_complete(config):
    params = model_parameters(config.as_dict())
    complete_config(config, diffusion_inputs(params.get("embeds_dtype", "float32")), diffusion_outputs())
    if config.as_dict().get("max_batch_size", 0) == 0:
        config.set_max_batch_size(8)
    config.set_dynamic_batching()
    return config


def runner_config(model_config: dict, args: dict) -> tuple[DiffusionRunnerConfig, Placement]:
    """The runner's config and where this instance runs."""
    params = model_parameters(model_config)
    placement, parallel = _placement(args, params)
    return DiffusionRunnerConfig(
        model=params.get("model", "demo:tiny-sd"),
        device=placement.device,
        dtype=params.get("dtype", "auto"),
        batch_size=int(model_config.get("max_batch_size") or 8),
        exact_batching=params.get("exact_batching", "true").lower(),
        cuda_graphs=params.get("cuda_graphs", "true").lower() == "true",
        limits=json_parameter(params, "limits"),
        defaults=json_parameter(params, "defaults"),
        gpu_memory_utilization=gpu_share(params),
        batching=params.get("batching", "request"),
        max_rows=int(params.get("max_rows", "0")),
        on_full=params.get("on_full", "wait"),
        group_order=params.get("group_order", "most_behind"),
        steps_ahead=int(params.get("steps_ahead", str(STEPS_AHEAD))),
        step_cache=params.get("step_cache", "off"),
        compile=params.get("compile", "off"),
        quantization=params.get("quantization", "none"),
        fp8_kept=_patterns(params["fp8_kept"]) if "fp8_kept" in params else None,
        fp8_scales=params.get("fp8_scales", "row"),
        fuse_projections=params.get("fuse_projections", "false").lower() == "true",
        gelu_epilogue=params.get("gelu_epilogue", "false").lower() == "true",
        attention_backend=params.get("attention_backend", "auto"),
        **lora_settings(params, args),
        lora_fuse=params.get("lora_fuse", "false").lower() == "true",
        **parallel,
    ), placement


def _placement(args: dict, params: dict[str, str]) -> tuple[Placement, dict]:
    """(this instance's placement, the runner's parallel settings). The ``parallel`` model parameter:

    - ``cfg`` with ``gpus: "A,B"`` (``omni-triton serve --place diffusion=cfg:A,B``): the instance
      runs on GPU A and its negative prompts' passes on GPU B;
    - ``sp`` with ``gpus: "A,B,..."`` (``--place diffusion=sp:A,B``): the instance runs on GPU A
      and each forward of its transformer over all of them (sequence parallel). On the CPU (no
      ``gpus``), ``sp_ranks`` processes (2 unless set), and for ``cfg`` a second process: the
      same code paths, for trying them out.
    """
    parallel = params.get("parallel", "none")
    if parallel == "none":
        return place_instance(args, params), {}
    if parallel not in ("cfg", "sp"):
        raise ValueError(f"model parameter parallel must be 'none', 'cfg' or 'sp', got {parallel!r}")
    kind = args.get("model_instance_kind")
    if not params.get("gpus", "").strip():
        placement = place_instance(args, params)
        if placement.device == "cpu" and parallel == "cfg":
            return placement, {"cfg_device": "cpu"}
        if placement.device == "cpu":
            ranks = int(params.get("sp_ranks", "2"))
            if ranks < 2:
                raise ValueError(f"model parameter sp_ranks must be at least 2, got {ranks}")
            return placement, {"sp_devices": ("cpu",) * (ranks - 1)}
    gpus = parse_gpus(params.get("gpus", ""))
    wanted = "two GPUs" if parallel == "cfg" else "two GPUs or more"
    if (len(gpus) != 2 if parallel == "cfg" else len(gpus) < 2) or kind != "MODEL":
        raise ValueError(f"parallel {parallel!r} needs a KIND_MODEL instance and {wanted} in the gpus parameter "
                         f"(e.g. \"0,1\"), got gpus {params.get('gpus', '')!r}")
    placement = place_instance(args, params | {"gpus": str(gpus[0])})
    others = [f"cuda:{g}" for g in gpus[1:]]
    return placement, {"cfg_device": others[0]} if parallel == "cfg" else {"sp_devices": tuple(others)}


def _patterns(value: str) -> tuple[str, ...]:
    """A comma-separated list of layer-name patterns (``fp8_kept``: ``""`` keeps none)."""
    return tuple(pattern.strip() for pattern in value.split(",") if pattern.strip())
