"""Small guards for request validation, the vLLM ``_verify_args`` way.

Each guard raises :class:`RequestValidationError` naming the parameter and the
value, so request types read as a flat list of checks.

Values reach the guards from typed tensors, from JSON, or from Triton request
parameters. JSON and request parameters carry numbers and booleans either as
themselves or in their string forms (``"0.1"``, ``"32"``, ``"true"``): Triton's
vLLM backend converts those, and its clients (``samples/client.py``,
``genai-perf --backend vllm``) send them. So every scalar guard accepts both;
a string that is not a number is still an error naming the parameter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from triton_omni.errors import RequestValidationError

INT64_MAX = 2**63 - 1
MAX_JSON_CHARS = 1_000_000  # a sampling-parameters object is a few hundred bytes


def require(condition: bool, parameter: str, reason: str, value: Any) -> None:
    if not condition:
        raise RequestValidationError(parameter, reason, value)


def as_int(parameter: str, value: Any) -> int:
    """An integer, an integral float (JSON's ``3.0``), or a string of one
    (``"32"``); never a bool. Bounded to int64, so every value fits the
    engines and the tensors it may end up in."""
    number = _from_string(value, int)
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise RequestValidationError(parameter, "must be an integer", value)
    if isinstance(number, float) and not number.is_integer():
        raise RequestValidationError(parameter, "must be an integer", value)
    number = int(number)
    require(-INT64_MAX - 1 <= number <= INT64_MAX, parameter, "must fit in a signed 64-bit integer", value)
    return number


def as_int32(parameter: str, value: Any) -> int:
    """``as_int``, bounded to a signed 32-bit integer (the options that travel as INT32 tensors)."""
    number = as_int(parameter, value)
    require(-(2**31) <= number < 2**31, parameter, "must fit in a signed 32-bit integer", value)
    return number


def as_float(parameter: str, value: Any) -> float:
    """A finite number, or a string of one (``"0.1"``); NaN and infinities are rejected."""
    number = _from_string(value, float)
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise RequestValidationError(parameter, "must be a number", value)
    try:
        number = float(number)
    except OverflowError:
        raise RequestValidationError(parameter, "must be a finite number", value) from None
    require(math.isfinite(number), parameter, "must be a finite number", value)
    return number


_BOOL_STRINGS = {"true": True, "false": False, "1": True, "0": False}


def as_bool(parameter: str, value: Any) -> bool:
    """``true``/``false``, or their string forms (any case) and ``0``/``1``.

    Triton's vLLM backend converts with ``bool(value)``, which makes the
    string ``"false"`` true; this guard reads it as false."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOL_STRINGS:
        return _BOOL_STRINGS[value.strip().lower()]
    raise RequestValidationError(parameter, "must be a boolean (true or false)", value)


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


def as_int_list(parameter: str, value: Any) -> list[int]:
    """A list of integers (each may be a string of one)."""
    if not isinstance(value, list | tuple):
        raise RequestValidationError(parameter, "must be a list of integers", value)
    try:
        return [as_int(parameter, item) for item in value]
    except RequestValidationError:
        raise RequestValidationError(parameter, "must be a list of integers", value) from None


def as_optional_int(parameter: str, value: Any) -> int | None:
    return None if value is None else as_int(parameter, value)


def as_json_value(parameter: str, value: Any) -> Any:
    """A JSON object given as itself or as a JSON string (Triton's vLLM
    backend sends nested options such as ``structured_outputs`` as strings)."""
    if isinstance(value, str):
        return as_json_object(parameter, value)
    require(isinstance(value, dict), parameter, "must be a JSON object", value)
    return value


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
    require(len(raw) <= MAX_JSON_CHARS, parameter, f"is longer than {MAX_JSON_CHARS} characters", len(raw))
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError(parameter, f"is not valid JSON ({exc.msg})", raw) from None
    except RecursionError:
        raise RequestValidationError(parameter, "is nested too deeply", raw[:40]) from None
    require(isinstance(values, dict), parameter, "must be a JSON object", raw)
    return values


def _from_string(value: Any, kind: type) -> Any:
    """``"32"`` -> 32, ``"0.1"`` -> 0.1; anything else is returned unchanged
    for the caller to reject with its own message."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        return int(text) if kind is int and text.lstrip("+-").isdigit() else float(text)
    except ValueError:
        return value
