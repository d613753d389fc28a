"""Small guards for request validation, the vLLM ``_verify_args`` way.

Each guard raises :class:`RequestValidationError` naming the parameter and the
value, so request types read as a flat list of checks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from triton_omni.errors import RequestValidationError


def require(condition: bool, parameter: str, reason: str, value: Any) -> None:
    if not condition:
        raise RequestValidationError(parameter, reason, value)


def as_int(parameter: str, value: Any) -> int:
    """Accept ints (and integral floats from JSON), never bools or strings."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestValidationError(parameter, "must be an integer", value)
    if isinstance(value, float) and not value.is_integer():
        raise RequestValidationError(parameter, "must be an integer", value)
    return int(value)


def as_float(parameter: str, value: Any) -> float:
    """Accept finite numbers only; NaN and infinities are rejected here."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestValidationError(parameter, "must be a number", value)
    value = float(value)
    require(math.isfinite(value), parameter, "must be a finite number", value)
    return value


def as_bool(parameter: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestValidationError(parameter, "must be a boolean", value)
    return value


def as_str(parameter: str, value: Any) -> str:
    if not isinstance(value, str):
        raise RequestValidationError(parameter, "must be a string", value)
    return value


def as_str_list(parameter: str, value: Any) -> list[str]:
    """A string or a list of strings (normalised to a list)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, bytes | dict):
        items = list(value)
        if all(isinstance(item, str) for item in items):
            return items
    raise RequestValidationError(parameter, "must be a string or a list of strings", value)


def in_range(parameter: str, value: float, low: float | None = None, high: float | None = None) -> None:
    """Inclusive range check with a message that states the allowed range."""
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise RequestValidationError(parameter, f"must be in {bounds}", value)


def as_json_object(parameter: str, raw: Any) -> dict[str, Any]:
    """A JSON object sent as a string (``sampling_parameters``, ``parameters``); absent means empty."""
    if raw is None:
        return {}
    raw = as_str(parameter, raw)
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError(parameter, f"is not valid JSON ({exc.msg})", raw) from None
    require(isinstance(values, dict), parameter, "must be a JSON object", raw)
    return values
