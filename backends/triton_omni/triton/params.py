"""Model parameters (``parameters { key: ... }`` in config.pbtxt) and instance placement."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_omni.gpu_memory import parse_gpus, visible_to_physical


def model_parameters(model_config: dict) -> dict[str, str]:
    return {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}


def json_parameter(params: dict[str, str], key: str) -> dict[str, Any]:
    raw = params.get(key, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"model parameter {key!r} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"model parameter {key!r} must be a JSON object, got {raw!r}")
    return value


def gpu_share(params: dict[str, str]) -> float | None:
    """The ``gpu_memory_utilization`` parameter (the model's share of its GPU), if set."""
    raw = params.get("gpu_memory_utilization", "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"model parameter 'gpu_memory_utilization' must be a number in (0, 1], got {raw!r}") \
            from None


@dataclass(frozen=True)
class Placement:
    """Where one model instance runs: its torch device and the GPUs it uses
    (physical indexes, as ``nvidia-smi`` and Triton's ``nv_gpu_*`` metrics
    number them; empty on the CPU)."""

    device: str
    gpus: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """The ``device`` label of the stage metrics: ``cpu``, ``gpu1``, ``gpu0+gpu1``."""
        return "+".join(f"gpu{g}" for g in self.gpus) or "cpu"


def place_instance(args: dict, params: dict[str, str], spans_gpus: bool = False) -> Placement:
    """Where this model instance runs (docs/gpu.md, "Several GPUs").

    - ``KIND_GPU``: the GPU Triton assigned it; ``KIND_CPU``: the CPU;
    - ``KIND_MODEL``: the GPUs of the ``gpus`` model parameter (``"0,1"``),
      else the first GPU when there is one (or the ``device`` parameter).

    ``spans_gpus``: the engine places itself over every GPU it can see, as
    vLLM does (tensor parallel over ``cuda:0..n-1``). This process then sees
    only its own GPUs (``CUDA_VISIBLE_DEVICES``, set before CUDA starts
    here or in the engine's processes), and the device is ``cuda``. A torch
    runner keeps every GPU visible and runs on ``cuda:N``: a tensor it hands
    to Triton through DLPack names its device by that number, which the
    server must read the same way.
    """
    kind = args.get("model_instance_kind", "CPU")
    if kind == "CPU":
        return Placement("cpu")
    if kind == "GPU":
        ordinals = [int(args.get("model_instance_device_id", 0))]
    elif params.get("gpus", "").strip():
        ordinals = parse_gpus(params["gpus"])
    else:
        requested = params.get("device", "auto")
        if requested == "auto":
            import torch

            requested = "cuda" if torch.cuda.is_available() else "cpu"
        if not requested.startswith("cuda"):
            return Placement(requested)
        ordinals = [int(requested.split(":")[1]) if ":" in requested else 0]
    physical = tuple(visible_to_physical(o) for o in ordinals)
    if spans_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in physical)
        return Placement("cuda", physical)
    if len(ordinals) > 1:
        raise ValueError(f"model parameter 'gpus' lists {len(ordinals)} GPUs ({params['gpus']!r}), but this engine "
                         "runs on one: use a KIND_GPU instance_group with those gpus for one instance on each")
    return Placement(f"cuda:{ordinals[0]}", physical)


def split_parameters(request) -> tuple[dict[str, Any], str | None, str | None]:
    """A request's parameters, read once: ``(the client's, channel key,
    progress listener)``. The client's are what a client set (gRPC/HTTP
    ``parameters``, the keys of an HTTP ``/generate`` body that are not
    inputs); the channel ids are set by the ``omni`` scheduler on the requests
    it sends (see ``triton_omni.channel``), else None."""
    from triton_omni.channel import KEY_PARAMETER, PROGRESS_PARAMETER, REPLY_PARAMETER, valid_id
    from triton_omni.errors import RequestValidationError

    try:
        params = json.loads(request.parameters() or "{}")
    except json.JSONDecodeError:
        raise RequestValidationError("parameters", "request parameters are not valid JSON", None,
                                     show_value=False) from None
    client = {key: value for key, value in params.items()
              if key not in (KEY_PARAMETER, PROGRESS_PARAMETER, REPLY_PARAMETER)}
    return client, valid_id(params.get(KEY_PARAMETER)), valid_id(params.get(PROGRESS_PARAMETER))


def reply_name(request) -> str | None:
    """The ``ReplyWriter`` the scheduler writes the rest of a reply to (``omni_reply``), if any."""
    from triton_omni.channel import REPLY_PARAMETER, valid_id

    return valid_id(json.loads(request.parameters() or "{}").get(REPLY_PARAMETER))


def channel_ids(request) -> tuple[str | None, str | None]:
    """The scheduler's ``(key, progress listener)`` of a request it sent; ``(None, None)`` otherwise."""
    from triton_omni.errors import RequestValidationError

    try:
        _, key, listener = split_parameters(request)
    except (AttributeError, RequestValidationError):
        return None, None
    return key, listener


def client_parameters(request) -> dict[str, Any]:
    return split_parameters(request)[0]


def lora_settings(params: dict[str, str], args: dict) -> dict[str, Any]:
    """The runner's ``lora_adapters`` (a relative path taken from the model's folder in its
    repository, Triton's ``model_repository`` argument) and ``max_loras``, from model parameters."""
    from triton_omni.lora import parse_sources

    repository = args.get("model_repository")
    return {"lora_adapters": parse_sources(params.get("lora_adapters", ""), Path(repository) if repository else None),
            "max_loras": int(params.get("max_loras", "4"))}
