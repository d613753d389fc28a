"""Model parameters (``parameters { key: ... }`` in config.pbtxt) and instance placement."""

from __future__ import annotations

import json
from typing import Any


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


def instance_device(args: dict, requested: str = "auto") -> str:
    """The torch device of this model instance.

    KIND_GPU instances run on the GPU Triton assigned them; KIND_CPU on the
    CPU; KIND_MODEL (and the ``device`` parameter's ``auto``) use the first
    GPU when there is one.
    """
    kind = args.get("model_instance_kind", "CPU")
    if kind == "GPU":
        return f"cuda:{args.get('model_instance_device_id', 0)}"
    if kind == "CPU":
        return "cpu"
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def split_parameters(request) -> tuple[dict[str, Any], str | None, str | None]:
    """A request's parameters, read once: ``(the client's, channel key,
    progress listener)``. The client's are what a client set (gRPC/HTTP
    ``parameters``, the keys of an HTTP ``/generate`` body that are not
    inputs); the channel ids are set by the ``omni`` scheduler on the requests
    it sends (see ``triton_omni.channel``), else None."""
    from triton_omni.channel import KEY_PARAMETER, PROGRESS_PARAMETER, valid_id
    from triton_omni.errors import RequestValidationError

    try:
        params = json.loads(request.parameters() or "{}")
    except json.JSONDecodeError:
        raise RequestValidationError("parameters", "request parameters are not valid JSON", None,
                                     show_value=False) from None
    client = {key: value for key, value in params.items() if key not in (KEY_PARAMETER, PROGRESS_PARAMETER)}
    return client, valid_id(params.get(KEY_PARAMETER)), valid_id(params.get(PROGRESS_PARAMETER))


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
